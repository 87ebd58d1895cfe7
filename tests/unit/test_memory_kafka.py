"""The in-memory Kafka the simulators and the fakes run on: transactions, read_committed, groups and their fence.

Each test states a behaviour of real Kafka (and librdkafka) the queue's correctness depends on, so
the simulator cannot pass by modelling a friendlier broker.
"""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, KafkaError, KafkaException, TopicPartition

from outbox.kafka.memory.broker import BROKER_EPOCH, MemoryBroker
from outbox.kafka.memory.consumer import MemoryConsumer
from outbox.kafka.memory.transactions import TransactionalProducer
from outbox.kafka.memory.world import SimWorld

GROUP = {"group.id": "g", "isolation.level": "read_committed", "enable.partition.eof": True,
         "session.timeout.ms": 3000}


@pytest.fixture
def world():
    return SimWorld(7)


@pytest.fixture
def broker(world):
    broker = MemoryBroker(world)
    broker.create_topic("t", 2)
    broker.create_topic("m", 1, log_append_time=True)
    return broker


def joined(world, broker, *consumers, topics=("t",)):
    for consumer in consumers:
        consumer.subscribe(list(topics))
    world.run_until(world.now + 1.0)
    for consumer in consumers:
        assert consumer.poll(0) is None  # serves the assignment; at the end of an empty partition
    world.run_until(world.now + 0.5)
    for consumer in consumers:
        first = consumer.poll(0)  # reports the end once it sat there for fetch.wait.max.ms
        assert first is not None and first.error().code() == KafkaError._PARTITION_EOF
    return consumers


def read_all(consumer):
    return [(m.partition(), m.offset()) for m in consumer.consume(100, 0) if m.error() is None]


def test_a_transaction_is_invisible_until_committed_and_holds_back_what_follows(world, broker):
    (consumer,) = joined(world, broker, MemoryConsumer(broker, GROUP), topics=("m",))
    producer = TransactionalProducer(broker, {"transactional.id": "x"})
    producer.init_transactions()
    producer.begin_transaction()
    producer.produce("m", value=b"start", key=b"q")
    broker.append("m", 0, b"q", b"keepalive", None)  # after the open transaction's first record
    assert consumer.consume(10, 0) == [], "nothing past the last stable offset (its end was reported already)"
    assert consumer.get_watermark_offsets(TopicPartition("m", 0), cached=True) == (0, 2)
    producer.commit_transaction()
    assert read_all(consumer) == [(0, 0), (0, 1)], "both visible once committed; the control record is skipped"
    assert broker.log("m")[0][2].control


def test_an_aborted_transaction_is_never_read(world, broker):
    (consumer,) = joined(world, broker, MemoryConsumer(broker, GROUP), topics=("m",))
    producer = TransactionalProducer(broker, {"transactional.id": "x"})
    producer.init_transactions()
    producer.begin_transaction()
    producer.produce("m", value=b"start", key=b"q")
    producer.abort_transaction()
    broker.append("m", 0, b"q", b"end", None)
    assert read_all(consumer) == [(0, 2)]


def test_a_transaction_left_open_is_aborted_by_the_broker_after_its_timeout(world, broker):
    (consumer,) = joined(world, broker, MemoryConsumer(broker, GROUP), topics=("m",))
    producer = TransactionalProducer(broker, {"transactional.id": "x", "transaction.timeout.ms": 5000})
    producer.init_transactions()
    producer.begin_transaction()
    producer.produce("m", value=b"start", key=b"q")  # ... and its process dies
    broker.append("m", 0, b"q", b"keepalive", None)
    world.run_until(world.now + 4.9)
    assert read_all(consumer) == []
    world.run_until(world.now + 0.2)
    assert read_all(consumer) == [(0, 1)]


def test_the_end_of_a_partition_is_reported_only_when_quiet_and_moves_the_position_past_a_control_record(
        world, broker):
    """As librdkafka 2.16 does against Kafka 4.1.1 (measured): no end-of-partition event under steady
    traffic; after a transaction, position() stays at its control record until that event."""
    (consumer,) = joined(world, broker, MemoryConsumer(broker, GROUP), topics=("m",))
    producer = TransactionalProducer(broker, {"transactional.id": "x"})
    producer.init_transactions()
    producer.begin_transaction()
    producer.produce("m", value=b"start", key=b"q")
    producer.commit_transaction()
    assert read_all(consumer) == [(0, 0)]
    tp = TopicPartition("m", 0)
    assert consumer.position([tp])[0].offset == 1 and consumer.get_watermark_offsets(tp) == (0, 2)
    for _ in range(20):  # a marker every 0.25 s
        world.run_until(world.now + 0.25)
        broker.append("m", 0, b"q", b"keepalive", None)
        assert all(record.error() is None for record in consumer.consume(10, 0))
        assert consumer.position([tp])[0].offset == consumer.get_watermark_offsets(tp)[1]
    world.run_until(world.now + 0.6)
    (end,) = consumer.consume(10, 0)
    assert end.error().code() == KafkaError._PARTITION_EOF and end.offset() == 22


def test_markers_carry_the_brokers_append_time(world, broker):
    world.run_until(12.5)
    message = broker.append("m", 0, b"q", b"v", None)
    assert message.timestamp() == (TIMESTAMP_LOG_APPEND_TIME, round((BROKER_EPOCH + 12.5) * 1000))


def test_offsets_sent_with_a_stale_generation_are_refused_and_the_transaction_must_abort(world, broker):
    first, second = MemoryConsumer(broker, GROUP, name="a"), MemoryConsumer(broker, GROUP, name="b")
    joined(world, broker, first)
    metadata = first.consumer_group_metadata()
    second.subscribe(["t"])  # a rebalance: a new generation the first member has not learnt yet
    world.run_until(world.now + 0.3)
    producer = TransactionalProducer(broker, {"transactional.id": "x"})
    producer.init_transactions()
    producer.begin_transaction()
    producer.produce("m", value=b"start", key=b"q")
    with pytest.raises(KafkaException) as refused:
        producer.send_offsets_to_transaction([TopicPartition("t", 0, 5)], metadata)
    assert refused.value.args[0].txn_requires_abort() and not refused.value.args[0].fatal()
    producer.abort_transaction()
    assert broker.consumer_groups["g"].committed == {}


def test_a_partition_moves_only_after_its_owner_revoked_it(world, broker):
    revoked = []
    first = MemoryConsumer(broker, GROUP, name="a")
    first.subscribe(["t"], on_revoke=lambda consumer, tps: revoked.append([tp.partition for tp in tps]))
    world.run_until(1.0)
    first.poll(0)
    assert sorted(tp.partition for tp in first.assignment()) == [0, 1]
    second = MemoryConsumer(broker, GROUP, name="b")
    second.subscribe(["t"])
    world.run_until(2.0)
    second.poll(0)
    assert second.assignment() == [], "not until the owner's revoke callback returned"
    first.poll(0)
    assert len(revoked) == 1 and len(revoked[0]) == 1
    world.run_until(3.0)
    second.poll(0)
    assert [tp.partition for tp in second.assignment()] == revoked[0]


def test_a_member_paused_past_its_session_is_dropped_and_notices_only_after_it_resumes(world, broker):
    running = {"a": True}
    lost = []
    zombie = MemoryConsumer(broker, GROUP, name="a", alive=lambda: running["a"])
    zombie.subscribe(["t"], on_lost=lambda consumer, tps: lost.append(len(tps)))
    other = MemoryConsumer(broker, GROUP, name="b")
    world.run_until(1.0)
    zombie.poll(0)
    other.subscribe(["t"])
    world.run_until(2.0)
    zombie.poll(0)
    world.run_until(3.0)
    other.poll(0)
    running["a"] = False
    world.run_until(8.0)
    other.poll(0)
    assert len(other.assignment()) == 2, "the paused member's partition moved"
    running["a"] = True
    zombie.poll(0)
    assert lost == [] and len(zombie.assignment()) == 1, "a zombie for a moment"
    with pytest.raises(KafkaException) as refused:
        zombie.commit(offsets=[TopicPartition("t", 0, 1)], asynchronous=False)
    assert refused.value.args[0].code() == KafkaError.UNKNOWN_MEMBER_ID
    world.run_until(world.now + 0.1)
    zombie.poll(0)
    assert lost == [1] and zombie.assignment() == []


def test_a_one_partition_group_keeps_its_live_owner_when_a_member_ahead_of_it_rejoins(world, broker):
    """Cooperative-sticky: the leader election's partition stays with its owner while the owner lives, whoever
    joined first (a share rounded up goes to the member that holds partitions)."""
    running = {"a": True}
    first = MemoryConsumer(broker, GROUP, name="a", alive=lambda: running["a"])
    second = MemoryConsumer(broker, GROUP, name="b")
    first.subscribe(["m"])
    second.subscribe(["m"])
    world.run_until(1.0)
    first.poll(0), second.poll(0)
    assert [tp.partition for tp in first.assignment()] == [0] and second.assignment() == []
    running["a"] = False
    world.run_until(6.0)
    second.poll(0)
    assert [tp.partition for tp in second.assignment()] == [0], "the silent owner was dropped"
    running["a"] = True
    for _ in range(3):
        world.run_until(world.now + 0.5)
        first.poll(0), second.poll(0)
    assert first.assignment() == [] and [tp.partition for tp in second.assignment()] == [0]


def test_a_partition_moved_to_a_member_that_joins_goes_once_its_owner_revoked_it(world, broker):
    """The coordinator's freedom the one-table simulator uses (`move_chance`): the owner is revoked first."""
    broker.consumer_group("g", ["m"], 3.0, move_chance=1.0)
    first, second = MemoryConsumer(broker, GROUP, name="a"), MemoryConsumer(broker, GROUP, name="b")
    held = {"revoking": True}

    def revoke(consumer, tps):
        if held["revoking"]:
            raise RuntimeError("the thread is still inside the callback")
    first.subscribe(["m"], on_revoke=revoke)
    world.run_until(1.0)
    first.poll(0)
    second.subscribe(["m"])
    world.run_until(2.0)
    with pytest.raises(RuntimeError):
        first.poll(0)
    second.poll(0)
    assert second.assignment() == [] and first.assignment(), "not while the revoke callback has not returned"
    held["revoking"] = False
    first.poll(0)  # the callback is called again, and returns
    world.run_until(3.0)
    second.poll(0)
    assert first.assignment() == [] and [tp.partition for tp in second.assignment()] == [0]


def test_a_partition_with_no_committed_offset_starts_where_auto_offset_reset_says(world, broker):
    for n in range(3):
        broker.append("m", 0, b"k", b"%d" % n, None)
    latest = MemoryConsumer(broker, {"group.id": "late", "session.timeout.ms": 3000})
    earliest = MemoryConsumer(broker, {"group.id": "early", "auto.offset.reset": "earliest",
                                       "session.timeout.ms": 3000})
    latest.subscribe(["m"])
    earliest.subscribe(["m"])
    world.run_until(1.0)
    assert latest.consume(10, 0) == [], "librdkafka's default: the end"
    assert [m.value() for m in earliest.consume(10, 0)] == [b"0", b"1", b"2"]


def test_a_partition_bounced_is_revoked_and_assigned_back_to_its_owner_in_the_same_poll(world, broker):
    """The coordinator's freedom the shard simulator uses (`bounce()`): a revoke and the assignment that gives the
    partition straight back come in one poll, so the member's own view never lacks it."""
    calls: list[tuple[str, list[int]]] = []
    first = recording(broker, "a", calls)
    world.run_until(1.0)
    first.poll(0)
    assert calls == [("a assign", [0, 1])]
    broker.consumer_groups["g"].bounce(("t", 1))
    world.run_until(2.0)
    first.poll(0)
    assert calls[1:] == [("a revoke", [1]), ("a assign", [1])]
    assert sorted(tp.partition for tp in first.assignment()) == [0, 1]
    world.run_until(3.0)
    first.poll(0)
    assert len(calls) == 3, "nothing more"


def test_a_bounce_its_owner_never_answered_is_forgotten_when_the_owner_is_dropped(world, broker):
    """A member dropped before its revoke callback ran, that rejoins: a later move of the partition is a move (not
    a revoke followed by the partition handed straight back to it)."""
    calls: list[tuple[str, list[int]]] = []
    first = recording(broker, "a", calls)
    world.run_until(1.0)
    first.poll(0)
    group = broker.consumer_groups["g"]
    group.bounce(("t", 1))
    world.run_until(1.5)
    group.expire(group.members[0])  # before it polled the revoke
    for now in (2.0, 2.5, 3.0, 3.5):  # it notices it was dropped, and rejoins
        world.run_until(now)
        first.poll(0)
    assert sorted(tp.partition for tp in first.assignment()) == [0, 1]
    calls.clear()
    second = MemoryConsumer(broker, GROUP, name="b")
    second.subscribe(["t"])
    for now in (4.0, 4.5, 5.0, 5.5):
        world.run_until(now)
        first.poll(0)
        second.poll(0)
    assert calls == [("a revoke", [1])] and [tp.partition for tp in second.assignment()] == [1]


def recording(broker, name, calls):
    """A consumer of topic t that records its rebalance callbacks in `calls` as ("<name> assign", partitions)."""
    def record(kind: str) -> Any:
        return lambda _, tps: calls.append((f"{name} {kind}", sorted(tp.partition for tp in tps)))

    consumer = MemoryConsumer(broker, GROUP, name=name)
    consumer.subscribe(["t"], on_assign=record("assign"), on_revoke=record("revoke"))
    return consumer
