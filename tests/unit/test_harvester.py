"""The real engine against in-memory Kafka and Postgres: throttle, barrier, failures, fencing, revocation."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from confluent_kafka import KafkaError, KafkaException

from outbox.harvest import events
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.fakes import FakeKafka, FakeStore
from outbox.harvest.harvester import Harvester, HarvestError, State
from outbox.harvest.store import StoreError

TOPIC = "orders"


def wait_until(condition: Callable[[], object], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.002)
    raise AssertionError(f"timed out waiting for {what}")


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
        self.harvester = Harvester(self.config, on_event=self.events.append, store_factory=self.store.factory,
                                   **self.kafka.factories())

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
    message = rig.kafka.messages(TOPIC)[0]
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


def test_throttle_caps_records_in_flight(rig_factory):
    rig = rig_factory(auto_deliver=False, max_in_flight_records=5, mark_query_records=20)
    rig.store.add_many(TOPIC, [f"k{i}" for i in range(50)])
    rig.harvester.start()
    wait_until(lambda: rig.kafka.record_producers and len(rig.producer.pending) == 5, what="5 in flight")
    time.sleep(0.1)
    assert len(rig.producer.pending) == 5 and rig.harvester.in_flight_records == 5
    peak = 0
    while rig.store.rows:
        peak = max(peak, len(rig.producer.pending))
        rig.producer.deliver(1)
        time.sleep(0.001)
    assert peak <= 5
    assert len(rig.published()) == 50


def test_one_record_per_key_in_flight_and_barrier_lowered_only_after_purge(rig_factory):
    rig = rig_factory(auto_deliver=False)
    ids = rig.store.add_many(TOPIC, ["same"] * 5 + ["other"])
    rig.harvester.start()
    wait_until(lambda: rig.kafka.record_producers and len(rig.producer.pending) == 2, what="one per key")
    assert sorted(rig.harvester.in_flight_keys) == ["other", "same"]
    rig.store.purge_gate = threading.Event()  # the next purge does not commit until the gate opens
    rig.producer.deliver(1)  # Kafka acknowledges the first "same" record
    time.sleep(0.1)
    produced = [int(m.header("outbox-id")) for m in rig.producer.produced]
    assert produced == [ids[0], ids[5]], "acknowledged but not purged: the key's barrier must stay up"
    assert rig.harvester.in_flight_records == 2
    rig.store.purge_gate.set()
    wait_until(lambda: len(rig.producer.produced) == 3, what="next record of the key sent after the purge")
    assert ids[0] not in rig.store.rows
    assert int(rig.producer.produced[2].header("outbox-id")) == ids[1]
    rig.store.fail_purges = 3  # failing purges are retried; the barrier stays up meanwhile
    rig.producer.deliver(2)
    wait_until(lambda: len(rig.producer.produced) == 4, what="sent after retried purge")
    assert rig.store.fail_purges == 0
    while rig.store.rows:
        rig.producer.deliver()
        time.sleep(0.002)
    assert_per_key_order(rig.published())


def test_failed_delivery_resets_and_remarks_under_a_new_leader_id_before_sending_more(rig_factory):
    rig = rig_factory(auto_deliver=False)
    ids = rig.store.add_many(TOPIC, ["a", "b", "a", "b"])
    rig.harvester.start()
    wait_until(lambda: rig.kafka.record_producers and len(rig.producer.pending) == 2)
    first_leader = rig.harvester.leader_id
    rig.producer.deliver(1, error=KafkaError(KafkaError._MSG_TIMED_OUT))  # record "a" #1 fails
    wait_until(lambda: ids[0] in rig.store.resets, what="reset")
    time.sleep(0.05)
    assert len(rig.producer.produced) == 2, "nothing more may be sent until the remark"
    rig.producer.deliver(1)  # "b" #1 acknowledged: now nothing is in flight, the term is refreshed
    wait_until(lambda: len(rig.leader_ids()) == 2, what="LeaderRefreshed")
    assert rig.harvester.leader_id != first_leader
    assert "LeaderRefreshed" in rig.kinds()
    while rig.store.rows:
        rig.producer.deliver()
        time.sleep(0.002)
    published = rig.published()
    assert_per_key_order(published)
    assert sorted({record_id for _, record_id in published}) == ids
    assert published[1] == ("a", ids[0]), "the failed record is resent first for its key"


def test_mark_error_forces_a_remark_under_a_new_leader_id(rig_factory):
    rig = rig_factory()
    rig.store.fail_marks = 1  # the UPDATE commits, then the client sees an error
    ids = rig.store.add_many(TOPIC, [f"k{i % 3}" for i in range(30)])
    rig.harvester.start()
    wait_until(lambda: not rig.store.rows, what="drained")
    first, second = rig.leader_ids()[:2]
    assert first != second and "LeaderRefreshed" in rig.kinds()
    published = rig.published()
    assert sorted(record_id for _, record_id in published) == ids
    assert_per_key_order(published)


def test_queue_timeout_forces_a_remark(rig_factory):
    rig = rig_factory(auto_deliver=False, queue_timeout=0.1)
    rig.store.add_many(TOPIC, ["stuck", "stuck"])
    rig.harvester.start()
    wait_until(lambda: rig.kafka.record_producers and len(rig.producer.pending) == 1)
    time.sleep(0.3)  # the second record waits behind the unacknowledged first one
    assert "LeaderRefreshed" not in rig.kinds(), "no new id while a record is in flight"
    rig.producer.deliver()
    wait_until(lambda: "LeaderRefreshed" in rig.kinds(), what="remark after queue timeout")
    while rig.store.rows:
        rig.producer.deliver()
        time.sleep(0.002)


def test_leader_fences_itself_when_its_heartbeats_stop_and_resumes_with_a_new_id(rig_factory):
    rig = rig_factory(auto_deliver=False, heartbeat_timeout=0.2)
    rig.harvester.start()
    wait_until(lambda: rig.harvester.is_leader)
    first = rig.harvester.leader_id
    rig.kafka.heartbeats_lost = True
    wait_until(lambda: "LeaderFenced" in rig.kinds(), what="fenced")
    assert not rig.harvester.is_leader and rig.harvester.is_fenced
    rig.store.add_many(TOPIC, ["k1", "k2"])
    time.sleep(0.1)
    assert rig.producer.produced == [], "a fenced leader sends nothing"
    rig.kafka.heartbeats_lost = False
    wait_until(lambda: rig.harvester.is_leader, what="resumed")
    assert rig.harvester.leader_id not in (None, first)
    wait_until(lambda: len(rig.producer.produced) == 2)


def test_revocation_mid_batch_settles_in_flight_records_before_handing_over(rig_factory):
    rig = rig_factory(auto_deliver=False)
    ids = rig.store.add_many(TOPIC, [f"k{i}" for i in range(20)] * 3)
    rig.harvester.start()
    wait_until(lambda: rig.kafka.record_producers and len(rig.producer.pending) == 20)
    rig.kafka.move_partition_zero(to=None)  # Kafka rebalances partition 0 away

    def deliver_during_revoke() -> None:
        time.sleep(0.05)
        rig.producer.deliver()

    threading.Thread(target=deliver_during_revoke).start()
    wait_until(lambda: "LeaderRevoked" in rig.kinds(), what="revoked")
    # The revoke callback returned only after the 20 in-flight records were purged.
    assert rig.harvester.in_flight_records == 0
    assert len(rig.store.purged) == 20 and len(rig.producer.produced) == 20
    assert not rig.harvester.is_leader
    time.sleep(0.05)
    assert len(rig.producer.produced) == 20, "nothing sent after revocation"
    rig.kafka.move_partition_zero(to=rig.kafka.members[0])  # assigned back: a new term, a new id
    rig.kafka.auto_deliver = True
    wait_until(lambda: not rig.store.rows, what="drained after reassignment")
    assert len(set(rig.leader_ids())) == 2
    assert sorted({record_id for _, record_id in rig.published()}) == ids


def test_poison_record_holds_its_key_but_not_others(rig_factory):
    rig = rig_factory()
    poison = rig.store.add(TOPIC, "bad", "x" * 100)
    later_bad = rig.store.add(TOPIC, "bad", "fine but behind the poison")
    good = rig.store.add_many(TOPIC, [f"k{i}" for i in range(20)])

    def refuse(topic, key, value):
        if value == "x" * 100:
            return KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
        return None

    rig.kafka.refuse = refuse
    rig.harvester.start()
    wait_until(lambda: all(i not in rig.store.rows for i in good), what="other keys published")
    assert poison in rig.store.rows and later_bad in rig.store.rows, "held records stay in the table"
    assert "bad" in rig.harvester.held_keys
    assert all(key != "bad" for key, _ in rig.published())


def test_every_acquisition_gets_a_fresh_leader_id(rig_factory):
    rig = rig_factory(heartbeat_timeout=0.1)
    rig.harvester.start()
    for _ in range(3):
        wait_until(lambda: rig.harvester.is_leader)
        rig.kafka.heartbeats_lost = True
        wait_until(lambda: not rig.harvester.is_leader)
        rig.kafka.heartbeats_lost = False
    wait_until(lambda: rig.harvester.is_leader)
    ids = rig.leader_ids()
    assert len(ids) == 4 and len(set(ids)) == 4


def test_standby_sends_nothing_until_it_leads(rig_factory):
    leader, standby = rig_factory(), rig_factory()
    standby.kafka = leader.kafka  # both replicas in one group
    standby.harvester = Harvester(standby.config, on_event=standby.events.append,
                                  store_factory=leader.store.factory, **leader.kafka.factories())
    leader.harvester.start()
    wait_until(lambda: leader.harvester.is_leader)
    standby.harvester.start()
    leader.store.add_many(TOPIC, ["k"] * 10)
    wait_until(lambda: not leader.store.rows)
    assert not standby.harvester.is_leader and standby.kinds() == []
    leader.harvester.stop()
    leader.harvester.wait(timeout=5)
    wait_until(lambda: standby.harvester.is_leader, what="standby takes over on a graceful stop")
    leader.store.add_many(TOPIC, ["k"] * 5)
    wait_until(lambda: not leader.store.rows)


def test_start_failure_is_one_line_and_cleans_up():
    kafka = FakeKafka()

    def broken_store(dsn: str, table: str):
        raise StoreError("cannot connect to Postgres at h:5432/db: refused")

    harvester = Harvester(HarvestConfig(dsn="x"), store_factory=broken_store, **kafka.factories())
    with pytest.raises(HarvestError, match=r"^cannot connect to Postgres at h:5432/db: refused$"):
        harvester.start()
    assert harvester.state is State.CREATED and kafka.producers == []


def test_invalid_config_is_refused_at_start():
    harvester = Harvester(HarvestConfig(dsn="x", table="bad name"), **FakeKafka().factories())
    with pytest.raises(HarvestError, match="table"):
        harvester.start()


def test_background_failure_stops_the_harvester_and_wait_says_why(rig_factory):
    rig = rig_factory()

    def explode(ids):
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
    began = time.monotonic()
    rig.harvester.stop()
    assert time.monotonic() - began < 0.05
    assert rig.harvester.wait(timeout=5)
    assert rig.harvester.state is State.STOPPED
    assert rig.store.closed


def test_meter_reads_are_emitted(rig_factory):
    rig = rig_factory(min_metrics_interval=0.05)
    rig.store.add_many(TOPIC, [f"k{i}" for i in range(10)])
    rig.harvester.start()
    wait_until(lambda: any(isinstance(e, events.MeterRead) and e.stats.total_published == 10 for e in rig.events))
