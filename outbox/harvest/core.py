"""The harvester's core: one replica's leadership and records, as a single-threaded state machine.

Nothing here touches a socket, a thread or a clock. The driver (driver.py) feeds the core inputs:
the time (`tick`), leader-election events, the outcome of every command it ran. The core answers
with commands (commands.py): take the fence, mark, send, purge, reset, hold, park, let partition 0
go. Given the same inputs it gives the same commands, which is what lets a seeded simulator replay
a whole run, faults included.

`Core` is the front: every input and every question goes through it. What it decides lives in four
parts, one concern each (goharvest's mark/purge/reset, "MP/R", with the differences noted there):
- leadership.py: partition 0, heartbeats, the database fence, terms, revoke and stop;
- marking.py: when and from where to mark, and the watermark;
- lanes.py: per-key lanes, sending within the throttle, what settling frees (settling.py: purge, reset);
- poison.py: records that fail on their own, and the keys they hold.
Core is their mediator: a part gets what it needs of another as arguments (the active term, the count of queued
records) or from Core's own methods below ("for the parts"), and returns what another must hear (a delivery's
Verdict, the lanes a dispatch held) for Core to route; no part reaches another through Core.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from outbox.harvest import commands as cmd
from outbox.harvest import events
from outbox.harvest.commands import DeliveryError
from outbox.harvest.config import Limits
from outbox.harvest.contract import HeldRecord, Record, ReplicaState
from outbox.harvest.lanes import Entry, Judged, Lane, Lanes, Verdict
from outbox.harvest.lanes import check_invariants as check_lanes
from outbox.harvest.leadership import Leadership, Phase
from outbox.harvest.marking import Marking
from outbox.harvest.poison import PoisonBook

log = logging.getLogger("outbox.harvest")

__all__ = ["Core", "Phase", "Snapshot"]

#: Keys listed in a snapshot.
KEY_SAMPLE = 50


@dataclass(frozen=True)
class Snapshot:
    """What the replica reports about itself (status rows, metrics, health)."""

    state: ReplicaState
    #: The term it leads with (None while it does not lead with one).
    leader_id: uuid.UUID | None
    #: The leader id its rows in flight are marked under: the term's, or, while a term that ended
    #: (or is being refreshed) still has records in flight, that term's. Operators' tools treat rows
    #: marked with it as in flight.
    marking_id: uuid.UUID | None
    in_flight: int
    queued: int
    in_flight_keys: list[str]
    in_flight_key_count: int
    held: list[HeldRecord]
    fence_holder: str | None
    published: int
    failed: int
    #: The highest outbox id the term of `marking_id` has read.
    marked_upto: int | None = None


class Core:
    """One replica's brain. Not thread-safe: one thread feeds it (the engine, or the simulator).

    The parts are made from the classes below, so a test (a mutation in the simulator) can swap one."""

    leadership_class: type[Leadership] = Leadership
    marking_class: type[Marking] = Marking
    lanes_class: type[Lanes] = Lanes
    poison_class: type[PoisonBook] = PoisonBook

    def __init__(self, limits: Limits, *, new_leader_id: Callable[[], uuid.UUID] = uuid.uuid4,
                 park_after: int | None = None, now: float = 0.0, handoff_by_fence: bool = False,
                 leads: str = "partition 0 of the leader topic") -> None:
        self.limits = limits
        self.now = now
        #: A shard's engine (shards.py): Kafka hands its partition on at once, so the database fence is what
        #: orders a hand-off (leadership.py).
        self.handoff_by_fence = handoff_by_fence
        #: What being assigned makes this core lead, as its log lines say it.
        self.leads = leads
        #: Assert the core's invariants after every input (see check_invariants).
        self.checking = False
        self._commands: list[cmd.Command] = []
        self.published = 0
        self.failed = 0
        self.leadership = self.leadership_class(self, new_leader_id)
        self.marking = self.marking_class(self)
        self.lanes = self.lanes_class(self)
        self.poison = self.poison_class(self, park_after)

    # ============================================================================ the outside

    def take_commands(self) -> list[cmd.Command]:
        """What to do now; the caller runs them and reports back. Call after every input."""
        self._advance()
        if self.checking:
            self.check_invariants()
        commands, self._commands = self._commands, []
        return commands

    def check_invariants(self) -> None:
        """The core's own bookkeeping, asserted (as goharvest does in its loop); the simulator and the
        tests turn it on with `checking`, production does not pay for it."""
        check_lanes(self.lanes)
        if self.phase is Phase.ACTIVE:
            assert self.leading and self.leader_id is not None

    def next_deadline(self) -> float:
        """The latest time the core wants to be ticked again (it may be ticked any time before)."""
        active = self.phase is Phase.ACTIVE
        deadline = self.leadership.deadline(self.now + self.limits.drain_interval)
        if active:
            deadline = self.poison.deadline(self.marking.deadline(deadline, self.lanes.queued,
                                                                  self.leadership.force_remark))
        return max(self.now, self.lanes.deadline(deadline, active))

    def snapshot(self) -> Snapshot:
        leadership, lanes = self.leadership, self.lanes
        held = self.poison.snapshot()
        marking = leadership.leader_id if self.phase in (Phase.ACTIVE, Phase.DRAINING) else None
        if marking is None and (lanes.in_flight or self.poison.held):
            marking = leadership.last_term_id
        marked_upto = self.marking.high_water if marking is not None and self.marking.high_water else None
        holder = None if leadership.handing_over else leadership.fence_holder
        return Snapshot(state=self.state, leader_id=leadership.leader_id if self.phase is Phase.ACTIVE else None,
                        marking_id=marking, in_flight=lanes.in_flight, queued=lanes.queued,
                        in_flight_keys=list(itertools.islice(lanes.busy, KEY_SAMPLE)),
                        in_flight_key_count=len(lanes.busy), held=held, fence_holder=holder,
                        published=self.published, failed=self.failed, marked_upto=marked_upto)

    @property
    def state(self) -> ReplicaState:
        leadership = self.leadership
        if leadership.stopping:
            return ReplicaState.STOPPING
        if leadership.phase is Phase.BLOCKED:
            # Waiting for a shard's previous leader (of this group) to settle is a hand-off, not a conflict.
            return ReplicaState.STANDBY if leadership.handing_over else ReplicaState.BLOCKED
        if leadership.assigned and leadership.fenced:
            return ReplicaState.FENCED
        if leadership.leading:
            return ReplicaState.LEADER
        return ReplicaState.STANDBY

    @property
    def phase(self) -> Phase:
        return self.leadership.phase

    @property
    def leader_id(self) -> uuid.UUID | None:
        return self.leadership.leader_id

    @property
    def assigned(self) -> bool:
        return self.leadership.assigned

    @property
    def leading(self) -> bool:
        """Assigned partition 0 and seeing its own heartbeats: allowed to publish (fence permitting)."""
        return self.leadership.leading

    @property
    def stopping(self) -> bool:
        return self.leadership.stopping

    @property
    def finished(self) -> bool:
        """Stopped: settled after stop(), or gave up waiting (the shell then closes everything)."""
        return self.leadership.finished

    @property
    def in_flight(self) -> int:
        return self.lanes.in_flight

    @property
    def queued(self) -> int:
        return self.lanes.queued

    @property
    def restarting_producer(self) -> bool:
        """RestartProducer was asked for and not answered yet."""
        return self.lanes.restarting

    @property
    def settled(self) -> bool:
        """Nothing sent is waiting for its outcome, and no purge or reset is pending."""
        return not self.lanes.in_flight

    # -- for the parts: what they may ask of the core, which routes it ---------------------------------

    def command(self, command: cmd.Command) -> None:
        self._commands.append(command)

    def announce(self, event: events.Event) -> None:
        self._commands.append(cmd.Announce(event))

    def abandon_queued(self) -> None:
        """Forget records not sent: they stay marked, and the next term re-marks them (and re-holds
        the poison among them: what is known of poison outlives the term)."""
        self.lanes.abandon_queued()
        self.poison.abandon()

    @property
    def remarking(self) -> bool:
        """The term is being re-marked (Leadership.remark): nothing more is sent meanwhile."""
        return self.leadership.force_remark

    def remark(self) -> None:
        """Send nothing more; once nothing is in flight a new leader id re-marks what is left (Leadership.remark)."""
        self.leadership.remark()

    def hold_lane(self, lane: Lane, entry: Entry) -> None:
        """The poison book holds a key on `entry` (Lanes.hold)."""
        self.lanes.hold(lane, entry)

    def retry_held(self, lane: Lane, record: Record) -> None:
        """The poison book sends a held record again, as `record` (Lanes.retry_held)."""
        self.lanes.retry_held(lane, record)

    def unhold(self, lane: Lane, *, gone: bool) -> None:
        """The poison book lets a key move on (Lanes.unhold); records of it left marked in the table are re-marked."""
        if self.lanes.unhold(lane, gone=gone):
            self.leadership.remark()

    def _judge(self, verdict: Verdict | None) -> None:
        """What a delivery report or a refusal says of a record, to the poison book."""
        if verdict is None:
            return
        poison, record_id = self.poison, verdict.entry.record.id
        if verdict.judged is Judged.PUBLISHED:
            poison.published(verdict.lane, verdict.entry)
        elif verdict.judged is Judged.SUSPECT:
            poison.suspect(record_id, verdict.reason)
        else:
            if verdict.judged is Judged.FAILED_ALONE:
                poison.unsuspect(record_id)
            poison.hold(verdict.lane, verdict.entry, verdict.reason)

    # ============================================================================ inputs: time

    def tick(self, now: float) -> None:
        """The time is `now`; earlier times are ignored."""
        if now > self.now:
            self.now = now
        self.leadership.tick(self.now)
        if self.leadership.watching_queue and self.lanes.queue_timed_out(self.now):
            self.leadership.queue_timed_out()
        self.lanes.tick(self.now)

    def abort(self, reason: str) -> None:
        """Give up every record in flight: the shell drops them from the producer and reports each failed."""
        self.lanes.abort(reason)

    # ============================================================================ inputs: leader election

    def on_polled(self, heartbeat_seen: bool = False) -> None:
        """The shell polled the leader topic (so Kafka knows this replica is alive), and whether one
        of this replica's own heartbeats came back."""
        self.leadership.on_polled(heartbeat_seen)

    def on_assigned(self) -> None:
        """Partition 0 of the leader topic was assigned to this replica: it leads."""
        self.leadership.on_assigned()

    def on_heartbeat_seen(self) -> None:
        """One of this replica's own heartbeats came back from the leader topic."""
        self.leadership.on_heartbeat_seen()

    def on_revoked(self) -> None:
        """Partition 0 is being revoked in a rebalance: ReleasePartition follows once what is in
        flight has settled (or after settle_timeout, having given it up). What is known of poison goes with
        partition 0: another replica may act on those records meanwhile."""
        assigned = self.assigned
        self.leadership.on_revoked()
        if assigned:
            self.poison.forget()

    def on_lost(self) -> None:
        """The assignment was lost (the session expired): another replica may lead already (and act on the
        records known as poison)."""
        assigned = self.assigned
        self.leadership.on_lost()
        if assigned:
            self.poison.forget()

    def stop(self) -> None:
        """Stop marking and sending; records in flight may still settle, for up to settle_timeout
        (then they are given up); `finished` says when the shell may close everything."""
        self.leadership.stop()

    # ============================================================================ inputs: the database

    def on_fence(self, leader_id: uuid.UUID, taken: bool, holder: str | None = None, *,
                 same_group: bool = False, unsettled: str | None = None) -> None:
        """The answer to TakeFence (`same_group`: the holder is a replica of this leader group; `unsettled`:
        taken, from a shard's previous leader whose fence went with its session, unsettled). Taken, a term
        begins, and its marks start from the table's head."""
        began = not self.leadership.active
        self.leadership.on_fence(leader_id, taken, holder, same_group, unsettled)
        if began and self.leadership.active:
            self.marking.begin(self.leadership.grace_until)

    def on_fence_failed(self, leader_id: uuid.UUID, error: str) -> None:
        """TakeFence raised (the database is unreachable): try again after io_error_backoff."""
        self.leadership.on_fence_failed(leader_id, error)

    def on_listening(self, listening: bool) -> None:
        """Whether a NOTIFY wakes this replica when rows are written (else it polls every mark_backoff)."""
        self.marking.listening = listening

    def on_notified(self) -> None:
        """A NOTIFY arrived: a writer committed rows (or an operator touched a held one)."""
        self.marking.notified()
        self.poison.notified()

    def on_marked(self, mark: cmd.Mark, records: list[Record], writers: frozenset[str] | None = frozenset()) -> None:
        """The rows a Mark read, sorted by id, and the transactions writing to the outbox just before
        (their virtual transaction ids; None: not read, as a mark without gaps does not)."""
        taken = self.marking.marked(mark, records, writers, self._term())
        if taken is not None:
            self.lanes.settling.mark_saw_fence = True  # it ran on the fence session, which held the fence
        lanes, poison = self.lanes, self.poison
        for record in taken or ():
            admitted = lanes.admit(record, poison.suspected(record.id))
            if admitted is None:
                continue
            if poison.taken(*admitted):  # known poison: held again, unsent
                lanes.hold(*admitted)
                poison.held_again(admitted[0])
            else:
                lanes.enqueue(*admitted)

    def on_mark_failed(self, mark: cmd.Mark, error: str) -> None:
        """A Mark raised: its UPDATE may have committed all the same, so re-mark rather than retry."""
        if self.marking.mark_failed(mark, error, self._term()):
            self.leadership.remark()

    def on_purged(self, fence_held: bool = True) -> None:
        """The last Purge committed: its rows are gone and their keys' slots are free. `fence_held`
        False: the purge found this replica's fence session no longer holding the fence."""
        if not fence_held:
            self.leadership.fence_lost()
        self.published += self.lanes.purged()

    def on_purge_failed(self, error: str) -> None:
        """The last Purge failed: it is retried after io_error_backoff; the slots stay taken meanwhile."""
        self.lanes.purge_failed(error)

    def on_reset(self, fence_held: bool = True) -> None:
        """The last Reset committed: the failed rows will be re-marked."""
        if not fence_held:
            self.leadership.fence_lost()
        self.failed += self.lanes.reset_done()

    def on_reset_failed(self, error: str) -> None:
        self.lanes.reset_failed(error)

    def on_held(self, record_id: int, version: int | None) -> None:
        """A Hold committed; `version` is the row's version after it (None: the row is not ours any more)."""
        self.poison.on_held(record_id, version, self.lanes.held_entry(record_id))

    def on_held_checked(self, check: cmd.CheckHeld, rows: dict[int, Record]) -> None:
        """The held rows CheckHeld asked for, as they are now (an id missing: the row is gone)."""
        self.poison.on_held_checked(rows)

    def on_held_check_failed(self, error: str) -> None:
        self.poison.on_held_check_failed(error)

    def on_parked(self, record_id: int, parked: bool) -> None:
        """A Park committed (`parked` False: the row was not there any more)."""
        self.poison.on_parked(record_id, parked, self.lanes.held_entry(record_id))

    def on_park_failed(self, record_id: int, error: str) -> None:
        self.poison.on_park_failed(record_id, error)

    # ============================================================================ inputs: Kafka

    def on_delivered(self, record_id: int, error: DeliveryError | None = None) -> None:
        """A delivery report: acknowledged (error None) or failed."""
        self._judge(self.lanes.delivered(record_id, error))

    def on_refused(self, record_id: int, error: DeliveryError) -> None:
        """produce() refused the record before it left the process (too large for the producer...)."""
        self._judge(self.lanes.refused(record_id, error))

    def on_backpressure(self, record_ids: Iterable[int]) -> None:
        """The producer's local queue was full: these records were not sent; send them a little later."""
        self.lanes.backpressure(record_ids)

    def on_producer_failed(self, error: DeliveryError) -> None:
        """The producer hit a fatal error: every record in it fails; it must be replaced."""
        log.error("Record producer failed, replacing it: %s", error)
        self.lanes.restart_producer()
        self.lanes.abort(f"the producer failed: {error}")

    def on_producer_restarted(self) -> None:
        self.lanes.restarting = False

    def on_producer_replaced(self) -> None:
        """The records go through a new producer (restarted, or rebuilt for smaller batches): until one of a
        key's records is acknowledged there, the key sends one at a time (lanes.py)."""
        self.lanes.producer_replaced()

    # ============================================================================ inside

    def _term(self) -> uuid.UUID | None:
        """The active term's leader id; None while no term is active."""
        return self.leadership.leader_id if self.leadership.active else None

    def _advance(self) -> None:
        """Everything the core can do now: start or refresh terms, mark, send, purge, reset."""
        lanes = self.lanes
        if lanes.aborted and not lanes.in_flight:
            lanes.aborted = False
        self.leadership.advance()
        phase = self.leadership.phase
        if phase is Phase.ACTIVE:
            self.poison.check()
            for lane in lanes.dispatch(self.leadership.force_remark):
                self.poison.held_again(lane)
            self.marking.mark(self.leadership.leader_id, lanes.queued, self.leadership.force_remark)
        lanes.flush_settling(fenced=phase in (Phase.ACTIVE, Phase.DRAINING),
                             active=phase is Phase.ACTIVE and not self.leadership.force_remark)
