"""The threaded Harvester (the shell around the core) against the in-memory fakes users get too.

The core's rules are tested without threads in tests/unit/test_core.py and the simulator; these
tests check the shell: its lifecycle, its threads, and that it carries the core's commands out.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from confluent_kafka import KafkaError, KafkaException

from outbox.harvest import dbtime, events
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.contract import ReplicaState
from outbox.harvest.fakes import FakeConnector, FakeKafka, FakeStore
from outbox.harvest.harvester import Harvester, HarvestError, State
from outbox.harvest.instruments import Instruments
from outbox.harvest.store import FenceHolder, StoreError
from tests.support import waiting

TOPIC = "orders"


def wait_until(condition: Callable[[], object], timeout: float = 5.0, what: str = "condition") -> None:
    waiting.wait_until(condition, timeout, what, interval=0.002)


class Rig:
    """A harvester wired to fakes, recording its events."""

    def __init__(self, *, auto_deliver: bool = True, **limits: float) -> None:
        defaults = {"min_poll_interval": 0.005, "heartbeat_timeout": 0.5, "io_error_backoff": 0.01,
                    "mark_backoff": 0.005, "min_metrics_interval": 0.2}
        self.kafka = FakeKafka(auto_deliver=auto_deliver)
        self.store = FakeStore()
        self.events: list[object] = []
        self.config = HarvestConfig(dsn="fake", leader_topic="test-leader", leader_group="g", name="replica-1",
                                    limits=Limits(**{**defaults, **limits}))
        self.harvester = Harvester(self.config, on_event=self.events.append,
                                   connector=FakeConnector(self.kafka, self.store))

    @property
    def producer(self):
        return self.kafka.record_producers[0]

    def leader_ids(self) -> list[object]:
        return [e.leader_id for e in self.events if isinstance(e, events.LeaderAcquired | events.LeaderRefreshed)]

    def published(self) -> list[tuple[str, int]]:
        return [(m.key().decode(), int(m.header("outbox-id"))) for m in self.kafka.messages(TOPIC)]

    def kinds(self) -> list[str]:
        return [type(e).__name__ for e in self.events if not isinstance(e, events.MeterRead)]


@pytest.fixture
def rig_factory() -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def make(**kwargs: float) -> Rig:
        rig = Rig(**kwargs)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.harvester.stop()
        with contextlib.suppress(HarvestError):  # a test may have made it fail on purpose
            assert rig.harvester.wait(timeout=10)


def assert_per_key_order(published: list[tuple[str, int]]) -> None:
    last: dict[str, int] = {}
    for key, record_id in published:
        assert record_id >= last.get(key, 0), f"reversal for key {key}: {record_id} after {last[key]}"
        last[key] = record_id


def test_publishes_everything_in_per_key_order_and_empties_the_table(rig_factory):
    rig = rig_factory()
    ids = rig.store.add_many(TOPIC, [f"k{i % 7}" for i in range(300)])
    rig.harvester.start()
    wait_until(lambda: not rig.store.rows, what="table drained")
    published = rig.published()
    assert sorted(record_id for _, record_id in published) == ids
    assert_per_key_order(published)
    # The first of k0's records (the topic's limit is read before anything is produced, so which key
    # goes first is not fixed).
    message = next(m for m in rig.kafka.messages(TOPIC) if m.key_text == "k0")
    assert message.header("outbox-id") == str(ids[0])
    assert message.header("outbox-create-time").endswith("Z")
    assert rig.kinds()[0] == "LeaderAcquired"


def test_headers_and_tombstones_are_published(rig_factory):
    rig = rig_factory()
    rig.store.add(TOPIC, "k", None, [("trace", "a"), ("trace", "b")])
    rig.harvester.start()
    wait_until(lambda: rig.kafka.messages(TOPIC))
    [message] = rig.kafka.messages(TOPIC)
    assert message.value() is None and message.key() == b"k"
    assert [name for name, _ in message.headers()] == ["trace", "trace", "outbox-id", "outbox-create-time"]


def test_standby_sends_nothing_until_it_leads(rig_factory):
    leader, standby = rig_factory(), rig_factory()
    standby.kafka = leader.kafka  # both replicas in one group
    standby.harvester = Harvester(standby.config, on_event=standby.events.append,
                                  connector=FakeConnector(leader.kafka, leader.store))
    leader.harvester.start()
    wait_until(lambda: leader.harvester.is_leader)
    standby.harvester.start()
    leader.store.add_many(TOPIC, ["k"] * 10)
    wait_until(lambda: not leader.store.rows, what="the leader to publish")
    assert not standby.harvester.is_leader and standby.kinds() == []
    assert all(p.produced == [] for p in leader.kafka.record_producers[1:]), "the standby sent nothing"
    leader.harvester.stop()
    leader.harvester.wait(timeout=5)
    wait_until(lambda: standby.harvester.is_leader, what="standby takes over on a graceful stop")
    leader.store.add_many(TOPIC, ["k"] * 5)
    wait_until(lambda: not leader.store.rows)


def test_a_leader_asks_for_its_listener_once_and_a_standby_never(rig_factory):
    """A standby holds no LISTEN session (the process's hub starts with its first listener)."""
    asked: dict[str, list[str]] = {"leader": [], "standby": []}

    class Counting(FakeConnector):
        def __init__(self, who: str, *args: object) -> None:
            super().__init__(*args)
            self.who = who

        def listener(self, channel: str) -> None:
            asked[self.who].append(channel)

    leader, standby = rig_factory(), rig_factory()
    leader.harvester = Harvester(leader.config, connector=Counting("leader", leader.kafka, leader.store))
    standby.harvester = Harvester(standby.config, connector=Counting("standby", leader.kafka, leader.store))
    leader.harvester.start()
    wait_until(lambda: leader.harvester.is_leader)
    standby.harvester.start()
    leader.store.add_many(TOPIC, ["k"] * 10)
    wait_until(lambda: not leader.store.rows, what="the leader to publish")
    wait_until(lambda: len(leader.kafka.record_producers) == 2, what="the standby to be running")
    assert [len(asked["leader"]), asked["standby"]] == [1, []]
    assert asked["leader"][0].startswith("outbox_")


def test_start_failure_is_one_line_and_cleans_up():
    kafka = FakeKafka()

    class Broken(FakeConnector):
        def open_store(self):
            raise StoreError("cannot connect to Postgres at h:5432/db: refused")

    harvester = Harvester(HarvestConfig(dsn="x"), connector=Broken(kafka))
    with pytest.raises(HarvestError, match=r"^cannot connect to Postgres at h:5432/db: refused$"):
        harvester.start()
    assert harvester.state is State.CREATED and kafka.record_producers == []


def test_invalid_config_is_refused_at_start():
    harvester = Harvester(HarvestConfig(dsn="x", table="bad name"), connector=FakeConnector())
    with pytest.raises(HarvestError, match="table"):
        harvester.start()


def test_background_failure_stops_the_harvester_and_wait_says_why(rig_factory):
    rig = rig_factory()

    def explode(items, read_fence=True, durable=True):
        raise RuntimeError("disk on fire")

    rig.store.purge = explode
    rig.store.add(TOPIC, "k")
    rig.harvester.start()
    with pytest.raises(HarvestError, match="disk on fire"):
        rig.harvester.wait(timeout=5)
    assert rig.harvester.state is State.STOPPED


def test_stop_returns_at_once_and_wait_blocks_until_stopped(rig_factory):
    rig = rig_factory()
    rig.harvester.start()
    wait_until(lambda: rig.harvester.is_leader)
    rig.harvester.stop()
    assert rig.harvester.state in (State.STOPPING, State.STOPPED), "stop() only asks"
    assert rig.harvester.wait(timeout=5)
    assert rig.harvester.state is State.STOPPED
    assert rig.store.closed


def test_meter_reads_are_emitted(rig_factory):
    rig = rig_factory(min_metrics_interval=0.05)
    rig.store.add_many(TOPIC, [f"k{i}" for i in range(10)])
    rig.harvester.start()
    wait_until(lambda: any(isinstance(e, events.MeterRead) and e.stats.total_published == 10 for e in rig.events))



def pair(rig_factory: Callable[..., Rig], **limits: float) -> tuple[Rig, Rig]:
    """Two replicas of one group over one FakeKafka and one table; the first leads."""
    leader, standby = rig_factory(**limits), rig_factory(**limits)
    standby.kafka, standby.store = leader.kafka, leader.store
    standby.harvester = Harvester(standby.config, on_event=standby.events.append,
                                  connector=FakeConnector(leader.kafka, leader.store))
    leader.harvester.start()
    wait_until(lambda: leader.harvester.is_leader, what="the first replica to lead")
    standby.harvester.start()
    wait_until(lambda: len(leader.kafka.consumers) == 2 and not leader.kafka.consumers[1].member.events,
               what="the second replica to join")
    return leader, standby


def test_a_revoked_leader_lets_partition_zero_go_only_once_its_records_settled(rig_factory):
    leader, standby = pair(rig_factory, auto_deliver=False)
    leader.store.add_many(TOPIC, ["k1", "k2", "k3"])
    wait_until(lambda: leader.producer.outstanding() == 3, what="three records in flight")
    leader.kafka.move_partition_zero(to=leader.kafka.consumers[1])
    wait_until(lambda: not leader.harvester.is_leader, what="the revoke to reach the leader")
    # The revoke waits in its callback: nobody leads while the records fly, however often the standby polls.
    standby_consumer = leader.kafka.consumers[1]
    polled = standby_consumer.polls
    wait_until(lambda: standby_consumer.polls >= polled + 20, what="the standby to poll twenty times")
    assert leader.kafka.group.revoking and not standby.harvester.is_leader
    leader.producer.deliver()
    wait_until(lambda: standby.harvester.is_leader, what="the standby to lead once the records settled")
    assert sorted(record_id for _, record_id in leader.published()) == [1, 2, 3]
    assert not leader.store.rows, "purged by the old leader before it let go"


def test_a_revoke_lets_go_after_the_settle_timeout_when_a_purge_hangs(rig_factory):
    leader, standby = pair(rig_factory, heartbeat_timeout=0.2, io_error_backoff=0.01)
    gate = leader.store.purge_gate = threading.Event()
    leader.store.add_many(TOPIC, ["k1", "k2"])
    wait_until(lambda: len(leader.published()) == 2, what="two records acknowledged, their purge hanging")
    began = time.monotonic()
    leader.kafka.move_partition_zero(to=leader.kafka.consumers[1])
    wait_until(lambda: standby.harvester.is_leader, timeout=10, what="the standby to lead after the settle timeout")
    waited = time.monotonic() - began
    settle = leader.config.limits.settle_timeout
    assert waited >= settle, f"let go after {waited:.2f}s, before the settle timeout ({settle:.2f}s)"
    gate.set()


def test_a_lost_partition_stops_sending_and_another_replica_leads(rig_factory):
    leader, standby = pair(rig_factory)
    leader.kafka.lose_partition_zero()
    wait_until(lambda: standby.harvester.is_leader, what="the standby to lead")
    wait_until(lambda: "LeaderRevoked" in leader.kinds(), what="the old leader to hear it lost partition 0")
    leader.store.add_many(TOPIC, ["k"] * 5)
    wait_until(lambda: not leader.store.rows, what="the new leader to publish")


def test_lost_heartbeats_fence_the_leader_until_they_come_back(rig_factory):
    rig = rig_factory(heartbeat_timeout=0.2, min_metrics_interval=0.02)
    rig.harvester.start()
    wait_until(lambda: rig.harvester.is_leader)
    rig.kafka.heartbeats_lost = True
    wait_until(lambda: rig.harvester.is_fenced, what="the leader to fence itself")
    rig.store.add(TOPIC, "k")
    turns = sum(isinstance(e, events.MeterRead) for e in rig.events)
    wait_until(lambda: sum(isinstance(e, events.MeterRead) for e in rig.events) >= turns + 5,
               what="the engine to meter five more times (a turn at least each) after the record was written")
    assert rig.published() == [], "a fenced leader sends nothing"
    rig.kafka.heartbeats_lost = False
    wait_until(lambda: not rig.store.rows, what="the leader to resume and publish")
    assert rig.kinds()[:2] == ["LeaderAcquired", "LeaderFenced"]


def test_failed_marks_and_purges_are_retried_under_a_new_leader_id(rig_factory):
    rig = rig_factory()
    rig.store.fail_marks = 2
    rig.store.fail_purges = 2
    ids = rig.store.add_many(TOPIC, [f"k{i % 3}" for i in range(30)])
    rig.harvester.start()
    wait_until(lambda: not rig.store.rows, what="the table to drain")
    assert sorted(set(record_id for _, record_id in rig.published())) == ids
    assert_per_key_order([p for p in rig.published()])
    assert len(rig.leader_ids()) >= 2, "a failed mark forces a refresh"


def test_a_record_the_producer_refuses_is_held_and_its_key_waits(rig_factory):
    rig = rig_factory()

    def refuse(topic, key, value):
        return KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "too large")) if value == b"big" or \
            value == "big" else None

    rig.kafka.refuse = refuse
    rig.store.add(TOPIC, "bad", "big")
    rig.store.add(TOPIC, "bad", "after")
    rig.store.add(TOPIC, "good", "fine")
    rig.harvester.start()
    wait_until(lambda: [key for key, _ in rig.published()] == ["good"], what="the other key to go on")
    wait_until(lambda: rig.harvester.held_keys.get("bad"), what="the key to be held")
    assert "RecordHeld" in rig.kinds()


def test_another_replica_holding_the_fence_blocks_the_leader(rig_factory):
    rig = rig_factory(fence_retry_interval=0.05)
    rig.store.fence_holder = FenceHolder(1, "other", "other-group", "elsewhere", same_group=False)
    rig.store.add(TOPIC, "k")
    rig.harvester.start()
    wait_until(lambda: rig.harvester.replica_state is ReplicaState.BLOCKED, what="the leader to be blocked")
    assert rig.published() == []
    rig.store.fence_holder = None
    wait_until(lambda: not rig.store.rows, what="publishing once the fence is free")


def test_every_database_round_trip_is_timed_by_kind_and_told_to_the_instruments(rig_factory):
    """What the harvester costs the database, as it sees it: each job's round trip, failed ones included."""
    seen: list[tuple[str, float, int]] = []

    class Recording(Instruments):
        def database(self, kind: str, seconds: float, rows: int) -> None:
            seen.append((kind, seconds, rows))

    rig = rig_factory()
    rig.harvester = Harvester(rig.config, connector=FakeConnector(rig.kafka, rig.store), instruments=Recording())
    rig.kafka.refuse = lambda topic, key, value: (KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "big"))
                                                  if value in (b"big", "big") else None)
    rig.store.fail_marks = 1
    rig.store.add(TOPIC, "bad", "big")
    ids = rig.store.add_many(TOPIC, [f"k{i % 3}" for i in range(30)])
    rig.harvester.start()
    wait_until(lambda: len(rig.store.rows) == 1 and rig.harvester.held_keys, what="all but the poison record")
    trips = rig.harvester.round_trips
    assert {"fence", "mark", "purge", "hold"} <= set(trips)
    assert set(trips) <= set(dbtime.ROUND_TRIP_KINDS)
    assert trips["purge"][2] == len(ids), "a purge's rows are the rows it deleted"
    assert trips["mark"][2] >= len(ids) + 1 and trips["hold"][2] == 1
    for kind, (count, seconds, rows) in trips.items():
        mine = [s for k, s, _ in seen if k == kind]
        assert count == len(mine) and seconds == pytest.approx(sum(mine)), kind
        assert seconds > 0 and rows == sum(r for k, _, r in seen if k == kind)
    first_mark = next(entry for entry in seen if entry[0] == "mark")
    assert first_mark[2] == 0, "the failed mark counts too, answering no rows"
    assert rig.harvester.status().round_trips.keys() == trips.keys()
