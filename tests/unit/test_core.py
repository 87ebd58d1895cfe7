"""The core, driven by hand: every input given, every command checked. No threads, no clocks, no I/O.

Each test reads as a conversation: what the shell tells the core, and what the core asks for.
"""

from __future__ import annotations

import itertools
import uuid
from datetime import UTC, datetime

import pytest

from outbox.harvest import commands as cmd
from outbox.harvest import events
from outbox.harvest.commands import DeliveryError
from outbox.harvest.config import Limits
from outbox.harvest.contract import Record, ReplicaState
from outbox.harvest.core import Core, Phase

TIMEOUT = DeliveryError("_MSG_TIMED_OUT", "Local: Message timed out")
TOO_LARGE = DeliveryError("MSG_SIZE_TOO_LARGE", "Broker: Message size too large", permanent=True)
NO_WRITERS: frozenset[str] = frozenset()  # nobody is writing to the outbox


class Driver:
    """A core plus the commands it gave since the last look."""

    def __init__(self, **limits: object) -> None:
        ids = (uuid.UUID(int=i) for i in itertools.count(1))
        # One record per key in flight (goharvest's barrier) unless a test pipelines; purges at once unless a
        # test delays them (the tests that do say so).
        defaults = {"mark_query_records": 10, "max_in_flight_records": 100, "max_in_flight_per_key": 1,
                    "heartbeat_timeout": 5.0, "queue_timeout": 30.0, "held_retry_after": 60.0, "min_poll_interval": 0.1,
                    "purge_delay": 0.0}
        self.core = Core(Limits(**{**defaults, **limits}), new_leader_id=lambda: next(ids))
        self.core.checking = True
        self.commands: list[cmd.Command] = []
        self.now = 0.0

    def take(self) -> list[cmd.Command]:
        self.commands = self.core.take_commands()
        return self.commands

    def of(self, kind: type) -> list:
        return [c for c in self.commands if isinstance(c, kind)]

    def one(self, kind: type):
        [command] = self.of(kind)
        return command

    def sent(self) -> list[int]:
        return [r.id for c in self.of(cmd.Send) for r in c.records]

    def events(self) -> list[str]:
        return [type(c.event).__name__ for c in self.of(cmd.Announce)]

    def advance(self, seconds: float) -> list[cmd.Command]:
        self.now += seconds
        self.core.tick(self.now)
        self.core.on_polled()
        return self.take()

    def wait(self, seconds: float) -> list[cmd.Command]:
        """Let time pass in small steps, the leader's own heartbeats coming back all along."""
        seen: list[cmd.Command] = []
        while seconds > 1e-9:
            step = min(0.5, seconds)
            self.core.on_heartbeat_seen()
            seen += self.advance(step)
            seconds -= step
        self.commands = seen
        return seen

    def lead(self) -> uuid.UUID:
        """Assigned partition 0, fence taken: a term begins and asks for a mark."""
        self.core.on_assigned()
        self.take()
        fence = self.one(cmd.TakeFence)
        self.core.on_fence(fence.leader_id, True)
        self.take()
        assert self.of(cmd.Mark), "a new term marks at once"
        return fence.leader_id

    def marked(self, records: list[Record], writers: frozenset[str] | None = NO_WRITERS) -> list[cmd.Command]:
        self.core.on_marked(self.one(cmd.Mark), records, writers)
        return self.take()

    def mark_again(self) -> cmd.Mark:
        """Time for the next mark (without waiting for a NOTIFY): the Mark asked for."""
        self.core.marking.next_mark_at = 0
        self.advance(0.1)
        return self.one(cmd.Mark)

    def deliver(self, *ids: int, error: DeliveryError | None = None) -> list[cmd.Command]:
        for record_id in ids:
            self.core.on_delivered(record_id, error)
        return self.take()

    def purged(self) -> list[cmd.Command]:
        self.core.on_purged()
        return self.take()


def rec(record_id: int, key: str, leader_id: uuid.UUID, value: str = "v") -> Record:
    return Record(record_id, datetime(2026, 1, 1, tzinfo=UTC), "orders", key, value, [], [], leader_id, record_id)


def test_a_term_takes_the_fence_before_it_marks_and_announces_itself():
    d = Driver()
    d.core.on_assigned()
    assert [type(c) for c in d.take()] == [cmd.TakeFence]
    leader_id = d.one(cmd.TakeFence).leader_id
    d.core.on_fence(leader_id, True)
    d.take()
    assert d.events() == ["LeaderAcquired"] and d.one(cmd.Mark).leader_id == leader_id
    assert d.core.state is ReplicaState.LEADER


def test_one_record_per_key_in_flight_and_the_slot_frees_only_when_the_purge_commits():
    d = Driver()
    lid = d.lead()
    d.marked([rec(1, "a", lid), rec(2, "a", lid), rec(3, "b", lid)])
    assert d.sent() == [1, 3], "one per key"
    d.deliver(1)
    assert d.sent() == [] and d.one(cmd.Purge).ids == (1,), "acknowledged: purge, nothing more sent"
    assert d.purged() and d.sent() == [2], "the purge committed: the key's next record goes"


def test_acknowledged_records_nothing_waits_on_are_purged_together_after_purge_delay():
    d = Driver(max_in_flight_per_key=4, purge_delay=0.1)
    lid = d.lead()
    d.marked([rec(1, "a", lid), rec(2, "b", lid), rec(3, "c", lid)])
    assert d.sent() == [1, 2, 3]
    d.deliver(1)
    assert d.of(cmd.Purge) == [], "nothing waits on key a's slot: its purge waits for more"
    assert d.core.lanes.deadline(100.0, True) == pytest.approx(0.1), "...for purge_delay after the first ack"
    d.advance(0.05)
    d.deliver(2, 3)
    assert d.of(cmd.Purge) == []
    d.advance(0.04)
    assert d.of(cmd.Purge) == []
    d.advance(0.011)
    assert d.one(cmd.Purge).ids == (1, 2, 3), "one statement for the three"


def test_a_failed_purge_goes_again_after_io_error_backoff_with_what_came_meanwhile_behind_it():
    """Its records go back in front, in their order: the purge after them must not settle a later record first."""
    d = Driver(max_in_flight_per_key=4, purge_delay=0.0, io_error_backoff=0.5)
    lid = d.lead()
    d.marked([rec(1, "a", lid), rec(2, "b", lid), rec(3, "c", lid)])
    d.deliver(1, 2)
    assert d.one(cmd.Purge).ids == (1, 2)
    d.deliver(3)
    assert d.of(cmd.Purge) == [], "one purge under way at most"
    d.core.on_purge_failed("connection lost")
    assert d.of(cmd.Purge) == [], "nothing before io_error_backoff"
    d.advance(0.49)
    assert d.of(cmd.Purge) == []
    d.advance(0.02)
    assert d.one(cmd.Purge).ids == (1, 2, 3), "the failed batch first, in its order, then the newer"
    assert d.purged() is not None and d.core.lanes.settling.purge.under_way is None


def test_a_purge_goes_at_once_when_a_record_waits_for_its_keys_slot():
    d = Driver(max_in_flight_per_key=1, purge_delay=10.0)
    lid = d.lead()
    d.marked([rec(1, "a", lid), rec(2, "b", lid)])
    d.deliver(2)
    assert d.of(cmd.Purge) == [], "key b has nothing behind it"
    d.mark_again()
    d.marked([rec(3, "a", lid)])
    assert d.one(cmd.Purge).ids == (2,), "3 waits for key a's slot: settling goes at once"
    d.purged()
    d.advance(0.01)
    d.deliver(1)
    assert d.one(cmd.Purge).ids == (1,)
    assert d.purged() and d.sent() == [3]


def test_a_purge_goes_at_once_when_the_throttle_is_full_or_the_term_ends():
    d = Driver(max_in_flight_records=2, max_in_flight_per_key=4, purge_delay=10.0)
    lid = d.lead()
    d.marked([rec(1, "a", lid), rec(2, "b", lid), rec(3, "c", lid)])
    assert d.sent() == [1, 2]
    d.deliver(1)
    assert d.one(cmd.Purge).ids == (1,), "3 waits for the throttle"
    d.purged()
    assert d.sent() == [3]
    d.deliver(2)
    assert d.of(cmd.Purge) == []
    d.advance(0.01)
    assert d.of(cmd.Purge) == [], "3 went: nothing waits"
    d.core.stop()
    d.take()
    assert d.one(cmd.Purge).ids == (2,), "stopping: settle what is in flight at once"


def test_a_purge_goes_at_once_when_a_marks_worth_is_acknowledged():
    d = Driver(mark_query_records=3, max_in_flight_per_key=4, purge_delay=10.0)
    lid = d.lead()
    d.marked([rec(1, "a", lid), rec(2, "b", lid), rec(3, "c", lid)])
    d.deliver(1, 2)
    assert d.of(cmd.Purge) == []
    d.deliver(3)
    assert d.one(cmd.Purge).ids == (1, 2, 3)


def test_the_throttle_caps_records_in_flight():
    d = Driver(max_in_flight_records=2)
    lid = d.lead()
    d.marked([rec(i, f"k{i}", lid) for i in range(1, 6)])
    assert d.sent() == [1, 2]
    d.deliver(1)
    assert d.sent() == []
    d.purged()
    assert d.sent() == [3]


def test_several_records_of_a_key_in_flight_are_purged_in_their_order():
    d = Driver(max_in_flight_per_key=3)
    lid = d.lead()
    d.marked([rec(i, "hot", lid) for i in range(1, 6)])
    assert d.sent() == [1], "a key's first record goes alone until it is acknowledged (lanes.py)"
    d.deliver(1)
    assert d.sent() == [2, 3] and d.one(cmd.Purge).ids == (1,)
    d.deliver(3)
    d.purged()
    assert d.sent() == [4]
    d.advance(0.1)
    assert d.of(cmd.Purge) == [], "3 waits for 2: a crash must never leave 2 to be re-sent after 3"
    d.deliver(2)
    assert d.one(cmd.Purge).ids == (2, 3)


def test_a_keys_first_record_to_another_topic_goes_alone_too():
    """A partition takes a producer's first batch whatever its sequence, whichever key's records it has:
    acknowledged in one topic, a key still sends its first record to another alone."""
    d = Driver(max_in_flight_per_key=8)
    d.lead()
    now = datetime.now(UTC)
    records = [Record(1, now, "orders", "k", "v"), Record(2, now, "orders", "k", "v"),
               Record(3, now, "audit", "k", "v"), Record(4, now, "audit", "k", "v")]
    d.marked(records)
    assert d.sent() == [1]
    d.deliver(1)
    assert d.sent() == [2], "acknowledged in orders; the first to audit waits until nothing of the key is in flight"
    d.deliver(2)
    d.purged()
    assert d.sent() == []
    d.advance(0.1)
    d.purged()
    assert d.sent() == [3]
    d.deliver(3)
    assert d.sent() == [4]


def test_a_new_producer_makes_every_key_send_one_record_at_a_time_again():
    """A partition that has nothing from a producer yet takes its first batch whatever its sequence
    (lanes.py): on a new producer a key's second record waits for its first one's ack again."""
    d = Driver(max_in_flight_per_key=8, max_in_flight_records=2)
    lid = d.lead()
    d.marked([rec(i, "hot", lid) for i in range(1, 6)])
    assert d.sent() == [1]
    d.deliver(1)
    assert d.sent() == [2], "the throttle: 1 waits for its purge"
    d.core.on_producer_replaced()
    d.purged()
    assert d.sent() == [], "a slot in the throttle, but the key has one in flight on the new producer"
    d.deliver(2)
    assert d.sent() == [3], "acknowledged: the key's records go together again, as the throttle allows"


def test_a_failed_delivery_resets_stops_sending_and_remarks_under_a_new_leader_id():
    d = Driver()
    first = d.lead()
    d.marked([rec(1, "a", first), rec(2, "b", first), rec(3, "a", first)])
    d.deliver(1, error=TIMEOUT)
    assert d.one(cmd.Reset).ids == (1,) and d.core.phase is Phase.DRAINING
    d.core.on_reset()
    d.take()
    assert d.sent() == [] and not d.of(cmd.TakeFence), "record 2 is still in flight: no new term yet"
    d.deliver(2)
    d.purged()
    second = d.one(cmd.TakeFence).leader_id
    assert second != first
    d.core.on_fence(second, True)
    d.take()
    assert d.events() == ["LeaderRefreshed"]
    d.marked([rec(1, "a", second), rec(3, "a", second)])
    assert d.sent() == [1], "the failed record goes again before the one marked after it"


def test_a_mark_error_remarks_under_a_new_leader_id_because_what_it_read_is_unknown():
    d = Driver()
    first = d.lead()
    d.core.on_mark_failed(d.one(cmd.Mark), "connection lost")
    d.take()
    second = d.one(cmd.TakeFence).leader_id
    assert second != first


def test_leader_ids_are_fresh_for_every_term():
    d = Driver(heartbeat_timeout=1.0)
    seen = []
    for _ in range(3):
        d.core.on_assigned() if not d.core.assigned else d.core.on_heartbeat_seen()
        d.take()
        fence = d.one(cmd.TakeFence)
        seen.append(fence.leader_id)
        d.core.on_fence(fence.leader_id, True)
        d.take()
        d.advance(1.5)  # no heartbeat: fenced
        assert d.core.state is ReplicaState.FENCED
    assert len(set(seen)) == 3


def test_a_leader_without_its_own_heartbeat_fences_itself_and_sends_nothing():
    d = Driver(heartbeat_timeout=1.0)
    lid = d.lead()
    d.marked([rec(1, "a", lid)])
    assert d.sent() == [1]
    d.advance(0.5)
    d.core.on_heartbeat_seen()
    d.advance(0.9)
    assert d.core.state is ReplicaState.LEADER, "a heartbeat 0.9 s ago keeps it leading"
    commands = d.advance(0.2)
    assert d.core.state is ReplicaState.FENCED and "LeaderFenced" in d.events()
    assert d.of(cmd.AbortSends) and d.of(cmd.ReleaseFence), "what is in flight is given up; the fence released"
    assert not any(isinstance(c, cmd.Send) for c in commands)
    d.core.on_delivered(1, DeliveryError("_PURGE_QUEUE", "purged"))
    d.take()
    d.core.on_reset()
    d.core.on_heartbeat_seen()
    d.take()
    assert d.of(cmd.TakeFence) and d.one(cmd.TakeFence).leader_id != lid, "resumes under a new leader id"


def test_a_queue_timeout_remarks():
    d = Driver(queue_timeout=2.0)
    lid = d.lead()
    d.marked([rec(1, "a", lid), rec(2, "a", lid)])
    d.advance(2.5)  # record 2 has waited behind 1 for longer than the queue timeout
    assert d.core.phase is Phase.DRAINING


def test_the_delivery_timeout_gives_up_records_in_flight():
    d = Driver(heartbeat_timeout=2.0)  # delivery_timeout: 3 s
    lid = d.lead()
    d.marked([rec(1, "a", lid)])
    d.core.on_heartbeat_seen()
    d.advance(1.9)
    assert not d.of(cmd.AbortSends)
    d.core.on_heartbeat_seen()
    d.advance(1.2)
    assert d.one(cmd.AbortSends)


def test_revocation_stops_sending_and_lets_in_flight_records_settle():
    d = Driver()
    lid = d.lead()
    d.marked([rec(1, "a", lid), rec(2, "a", lid)])
    d.core.on_revoked()
    d.take()
    assert d.events() == ["LeaderRevoked"] and d.of(cmd.ReleaseFence) and not d.of(cmd.AbortSends)
    assert not d.core.settled
    d.deliver(1)
    d.purged()
    assert d.core.settled and d.sent() == [], "settled, and the queued record is left for the next leader"


def test_a_record_that_fails_among_others_is_sent_again_alone_before_it_is_held():
    d = Driver()
    first = d.lead()
    d.marked([rec(1, "a", first), rec(2, "b", first), rec(3, "c", first)])
    for record_id in (1, 2, 3):  # the broker refused the whole batch
        d.core.on_delivered(record_id, TOO_LARGE)
    d.take()
    d.core.on_reset()
    d.take()
    second = d.one(cmd.TakeFence).leader_id
    d.core.on_fence(second, True)
    d.take()
    d.marked([rec(1, "a", second), rec(2, "b", second), rec(3, "c", second)])
    assert d.sent() == [1], "a suspect goes alone"
    d.deliver(1)
    assert d.sent() == [], "the next suspect waits for the first to settle"
    d.purged()
    assert d.sent() == [2]


def test_a_record_that_fails_alone_is_held_its_key_waits_and_other_keys_go_on():
    d = Driver()
    lid = d.lead()
    d.core.on_marked(d.one(cmd.Mark), [rec(1, "bad", lid)], NO_WRITERS)
    d.take()
    d.core.on_delivered(1, TOO_LARGE)  # alone in flight: guilty
    d.take()
    assert d.events() == ["RecordHeld"] and d.one(cmd.Hold).record_id == 1
    [held] = d.core.snapshot().held
    assert (held.id, held.key, held.reason, held.attempts) == (1, "bad", str(TOO_LARGE), 1)
    d.core.on_held(1, 500)
    d.core.marking.next_mark_at = 0
    d.take()
    d.marked([rec(2, "bad", lid), rec(3, "good", lid)])
    assert d.sent() == [3], "the held key waits; the other goes"
    assert d.core.state is ReplicaState.LEADER


def held_driver(**limits: object) -> tuple[Driver, uuid.UUID]:
    d = Driver(held_check_interval=1.0, **limits)
    lid = d.lead()
    d.marked([rec(1, "bad", lid), rec(2, "bad", lid), rec(3, "good", lid)])
    d.core.on_delivered(3)
    d.take()
    d.core.on_purged()
    d.take()
    d.core.on_delivered(1, TOO_LARGE)
    d.take()
    d.core.on_held(1, 500)
    return d, lid


def test_a_held_key_moves_again_when_its_poison_row_is_deleted():
    d, _ = held_driver()
    d.advance(1.1)
    check = d.one(cmd.CheckHeld)
    assert check.ids == (1,)
    d.core.on_held_checked(check, {})  # the row is gone
    d.take()
    assert "RecordReleased" in d.events() and d.sent() == [2]


def test_a_held_record_is_retried_alone_when_its_row_changes_and_the_key_moves_on_success():
    d, lid = held_driver()
    d.advance(1.1)
    check = d.one(cmd.CheckHeld)
    fixed = rec(1, "bad", lid, value="fixed")
    fixed.version = 501  # an operator's UPDATE
    d.core.on_held_checked(check, {1: fixed})
    d.take()
    assert d.sent() == [1] and d.one(cmd.Send).records[0].value == "fixed"
    d.deliver(1)
    assert "RecordReleased" in d.events()
    d.purged()
    assert d.sent() == [2]


def test_a_held_record_that_fails_again_stays_held_and_is_parked_after_park_after_failures():
    d = Driver(held_check_interval=1.0)
    d.core.poison.park_after = 2
    lid = d.lead()
    d.core.on_marked(d.one(cmd.Mark), [rec(1, "bad", lid)], NO_WRITERS)
    d.take()
    d.core.on_delivered(1, TOO_LARGE)
    d.take()
    d.core.on_held(1, 500)
    d.advance(1.1)
    touched = rec(1, "bad", lid)
    touched.version = 501
    d.core.on_held_checked(d.one(cmd.CheckHeld), {1: touched})
    d.take()
    assert d.sent() == [1]
    d.deliver(1, error=TOO_LARGE)
    assert d.one(cmd.Hold) and not d.of(cmd.Park), "parked once the Hold has answered, as the version it left"
    d.core.on_held(1, 502)
    d.take()
    park = d.one(cmd.Park)
    assert park.record.id == 1 and park.attempts == 2 and park.record.version == 502
    d.core.on_parked(1, True)
    d.take()
    assert d.events() == ["RecordParked", "RecordReleased"]


def test_a_leader_blocked_by_another_groups_fence_marks_nothing_and_retries():
    d = Driver(fence_retry_interval=5.0)
    d.core.on_assigned()
    d.take()
    lid = d.one(cmd.TakeFence).leader_id
    d.core.on_fence(lid, False, "replica x of leader group other on host y (pid 1)")
    d.take()
    assert d.core.state is ReplicaState.BLOCKED and d.events() == ["LeaderBlocked"] and not d.of(cmd.Mark)
    d.core.on_heartbeat_seen()
    d.advance(4.0)
    assert not d.of(cmd.TakeFence)
    d.core.on_heartbeat_seen()
    d.advance(1.5)
    assert d.one(cmd.TakeFence).leader_id == lid
    d.core.on_fence(lid, True)
    d.take()
    assert d.events() == ["LeaderAcquired"]
    assert not d.of(cmd.Mark), "the other group's last records land first"
    grace = d.core.limits.delivery_timeout + d.core.limits.heartbeat_timeout
    d.wait(grace - 0.5)
    assert not d.of(cmd.Mark)
    d.wait(0.6)
    assert d.of(cmd.Mark)


def test_a_purge_that_finds_the_fence_lost_stops_sending_at_once():
    d = Driver()
    lid = d.lead()
    d.marked([rec(1, "a", lid), rec(2, "a", lid), rec(3, "b", lid)])
    d.deliver(1)
    assert d.one(cmd.Purge).fenced, "record 2 waits on it: read although the mark just saw the fence"
    d.core.on_purged(fence_held=False)
    d.take()
    assert d.sent() == [] and d.of(cmd.AbortSends) and d.core.phase is Phase.DRAINING


def test_a_purge_nothing_waits_on_reads_the_fence_only_when_no_mark_saw_it_since_the_last_purge():
    d = Driver()
    lid = d.lead()
    d.marked([rec(1, "a", lid), rec(2, "b", lid), rec(3, "c", lid)])
    d.deliver(1)
    assert not d.one(cmd.Purge).fenced, "nothing waits, and the mark ran on the fence session holding the fence"
    d.purged()
    d.advance(0.1)
    d.deliver(2)
    assert d.one(cmd.Purge).fenced, "no mark since the last purge: this one reads the fence"
    d.purged()
    mark = d.core.marking.pending or d.mark_again()
    d.core.on_mark_failed(mark, "connection lost")  # a failed mark saw nothing
    d.take()
    d.advance(0.1)
    d.deliver(3)
    purges = d.of(cmd.Purge)
    assert purges and all(p.fenced for p in purges), "a failed mark does not stand for the fence"


def test_a_purge_reads_the_fence_when_the_throttle_waits_on_it():
    d = Driver(max_in_flight_records=2)
    lid = d.lead()
    d.marked([rec(1, "a", lid), rec(2, "b", lid), rec(3, "c", lid)])
    assert d.sent() == [1, 2], "the throttle is full: 3 waits"
    d.deliver(1)
    assert d.one(cmd.Purge).fenced, "3 waits on this purge: read although the mark just saw the fence"


def test_marks_read_on_from_the_highest_id_read_and_look_up_the_ids_not_yet_visible():
    d = Driver(mark_query_records=10)
    lid = d.lead()
    assert d.one(cmd.Mark).after == 0 and d.one(cmd.Mark).gaps == (), "a term starts at the head"
    # Rows 1 and 4 are visible; 2 and 3 belong to transactions still running.
    d.marked([rec(1, "a", lid), rec(4, "b", lid)], writers=frozenset({"3/7"}))
    mark = d.mark_again()
    assert (mark.after, mark.gaps) == (4, ((2, 3),)), "on from 4, and 2-3 looked up again"
    d.marked([rec(3, "c", lid)], writers=frozenset({"3/7"}))  # 3 committed; 2 still may
    mark = d.mark_again()
    assert mark.gaps == ((2, 2),)
    d.marked([], writers=frozenset({"3/7"}))
    assert d.mark_again().gaps == ((2, 2),), "the writer seen after the gap was recorded is still running"
    d.marked([], writers=frozenset({"4/1"}))  # 3/7 ended (rolled back): this lookup came after
    assert d.mark_again().gaps == (), "2 can never appear: forgotten"


def test_a_gap_is_watched_by_the_writers_seen_after_it_was_recorded():
    d = Driver(mark_query_records=10)
    lid = d.lead()
    # The writer of id 2 may have begun after the writers were read for this very mark.
    d.marked([rec(1, "a", lid), rec(3, "b", lid)], writers=NO_WRITERS)
    assert d.mark_again().gaps == ((2, 2),)
    d.marked([], writers=frozenset({"5/2"}))  # read after the gap was recorded: 5/2 may own id 2
    assert d.mark_again().gaps == ((2, 2),)
    d.marked([], writers=frozenset({"5/2"}))
    assert d.mark_again().gaps == ((2, 2),), "kept while 5/2 runs"
    d.marked([rec(2, "c", lid)], writers=NO_WRITERS)
    assert 2 in d.sent() or 2 in d.core.lanes.entries, "found when it committed, and taken"
    assert d.mark_again().gaps == ()


def test_a_full_mark_reads_on_at_once_from_the_highest_id_read():
    d = Driver(mark_query_records=2)
    lid = d.lead()
    d.marked([rec(1, "a", lid), rec(2, "b", lid)])
    assert d.one(cmd.Mark).after == 2, "full: the next rows at once, above the highest id read"
    d.marked([rec(3, "c", lid), rec(4, "d", lid)])
    assert d.one(cmd.Mark).after == 4


def test_a_mark_without_gaps_needs_no_writers_and_writers_not_read_forget_no_gap():
    d = Driver(mark_query_records=10)
    lid = d.lead()
    d.marked([rec(1, "a", lid)], writers=None)  # no gaps: the store reads no writers
    mark = d.mark_again()
    assert mark.gaps == ()
    d.marked([rec(3, "b", lid)], writers=None)
    assert d.mark_again().gaps == ((2, 2),)
    d.marked([], writers=None)  # (a store would read them here; a missing answer must not forget 2)
    assert d.mark_again().gaps == ((2, 2),), "not watched without writers"
    d.marked([], writers=frozenset({"5/2"}))
    d.mark_again()
    d.marked([], writers=NO_WRITERS)
    assert d.mark_again().gaps == (), "watched, then its writers ended: forgotten"


def test_rows_found_in_gaps_come_before_newer_rows_and_fill_the_mark_first():
    d = Driver(mark_query_records=3, max_in_flight_per_key=10)
    lid = d.lead()
    # Keys of their own: a causal writer never commits a key's row in a gap behind a later row of it.
    d.marked([rec(1, "a", lid), rec(5, "e", lid)], writers=frozenset({"1/1"}))
    mark = d.mark_again()
    assert mark.gaps == ((2, 4),)
    # The gap alone fills the mark: the rows above the high water wait for the next one.
    d.marked([rec(2, "b", lid), rec(3, "c", lid), rec(4, "d", lid), rec(6, "f", lid)], writers=NO_WRITERS)
    assert sorted(d.core.lanes.entries) == [1, 2, 3, 4, 5]
    assert d.core.marking.high_water == 5, "row 6 was not taken"


@pytest.mark.parametrize("how", ["revoked", "lost", "stopped"])
def test_leadership_ending_releases_the_fence(how):
    d = Driver()
    d.lead()
    getattr(d.core, {"revoked": "on_revoked", "lost": "on_lost", "stopped": "stop"}[how])()
    d.take()
    assert d.of(cmd.ReleaseFence)
    assert d.core.state is (ReplicaState.STOPPING if how == "stopped" else ReplicaState.STANDBY)
    assert d.core.snapshot().leader_id is None


def test_events_say_what_happened():
    d = Driver()
    d.lead()
    assert isinstance(d.of(cmd.Announce)[0].event, events.LeaderAcquired)
