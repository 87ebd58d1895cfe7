"""A report of delivery at an offset already written (Kafka's answer to a batch it took for a duplicate)
is not a delivery: acks.py decides, the driver hands the core a failure to retry instead. The
simulator's side (producers that number records from 0 again) is in tests/unit/test_simulation.py."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from confluent_kafka import KafkaError

from outbox.harvest import commands as cmd
from outbox.harvest.acks import AckOffsets
from outbox.harvest.contract import Record
from outbox.harvest.driver import Driver
from outbox.kafka.memory.broker import StoredMessage


def acked(offset: int, topic: str = "orders", partition: int = 0) -> StoredMessage:
    """A report's message: confluent_kafka.Message's accessors."""
    return StoredMessage(topic, partition, offset, None, None, None)


def test_new_offsets_are_deliveries_and_a_repeat_for_another_record_is_not():
    acks = AckOffsets()
    assert acks.repeated(acked(10)) is None
    assert acks.repeated(acked(11)) is None
    reason = acks.repeated(acked(10))
    assert reason is not None and "offset 10, where another record of this producer was written" in reason
    assert acks.repeated(acked(12)) is None  # sent again, written this time


def test_partitions_and_topics_have_offsets_of_their_own():
    acks = AckOffsets()
    assert acks.repeated(acked(0, partition=0)) is None
    assert acks.repeated(acked(0, partition=1)) is None
    assert acks.repeated(acked(0, topic="payments")) is None


def test_a_delivery_at_no_offset_is_not_one():
    """librdkafka's DUPLICATE_SEQUENCE_NUMBER: reported delivered, offset unknown (-1001)."""
    reason = AckOffsets().repeated(acked(-1001))
    assert reason is not None and "at no offset" in reason


def test_an_offset_far_below_the_last_is_a_log_that_began_again():
    """The topic deleted and re-created under the producer: its offsets start from 0 again, and are deliveries."""
    acks = AckOffsets(window=100)
    for offset in range(500, 700):
        assert acks.repeated(acked(offset)) is None
    assert acks.repeated(acked(0)) is None and acks.repeated(acked(1)) is None
    assert acks.repeated(acked(0)) is not None


def test_a_report_that_comes_late_is_remembered():
    acks = AckOffsets()
    assert acks.repeated(acked(3)) is None
    assert acks.repeated(acked(1)) is None
    assert acks.repeated(acked(2)) is None
    assert acks.repeated(acked(1)) is not None and acks.repeated(acked(3)) is not None


def test_offsets_older_than_the_window_are_forgotten():
    acks = AckOffsets(window=2)
    for offset in range(5):
        assert acks.repeated(acked(offset)) is None
    assert acks.repeated(acked(4)) is not None
    assert acks.repeated(acked(0)) is None  # forgotten: memory stays bounded


class Producer:
    def __init__(self) -> None:
        self.callbacks: list[Any] = []

    def produce(self, topic: str, value: Any = None, key: Any = None, headers: Any = None,
                on_delivery: Any = None) -> None:
        self.callbacks.append(on_delivery)


class IO:
    batch_limit = 10**9

    def __init__(self) -> None:
        self.producer = Producer()

    def topic_limit(self, topic: str) -> int:
        return 10**9

    def topic_limit_stale(self, topic: str) -> bool:
        return False

    def refused_for_size(self, topic: str | None) -> None:
        pass


class Core:
    """What the driver tells the core from _send."""

    def __init__(self) -> None:
        self.replaced = 0
        self.backpressure: list[int] = []

    def on_producer_replaced(self) -> None:
        self.replaced += 1

    def on_backpressure(self, ids: list[int]) -> None:
        self.backpressure.extend(ids)


def send(engine: Driver, *ids: int) -> None:
    now = datetime.now(UTC)
    engine._send(cmd.Send(tuple(Record(i, now, "orders", f"k{i}", "v", [], []) for i in ids)))


def sent(count: int) -> tuple[Driver, IO, Core]:
    io, core = IO(), Core()
    engine = Driver(core, io)  # type: ignore[arg-type]
    send(engine, *range(1, count + 1))
    return engine, io, core


def test_the_driver_reports_a_repeated_offset_as_a_failure_to_retry():
    engine, io, _ = sent(3)
    first, second, third = io.producer.callbacks
    first(None, acked(7))
    second(None, acked(8))
    third(None, acked(7))  # Kafka's answer to a batch it took for a duplicate of record 1's
    reports = list(engine._deliveries)
    assert [(record_id, error) for record_id, error in reports[:2]] == [(1, None), (2, None)]
    record_id, error = reports[2]
    assert record_id == 3 and error is not None
    assert error.code() == KafkaError.DUPLICATE_SEQUENCE_NUMBER and error.retriable() and not error.fatal()
    assert "where another record of this producer was written" in error.str()


def test_a_new_producer_gets_each_keys_first_record_alone_and_offsets_of_its_own():
    """A Send batched for the old producer goes back to the core, which sends each key's next record alone
    (lanes.py); a replacement producer's reports are not checked against the old one's offsets."""
    engine, io, core = sent(1)
    io.producer.callbacks[0](None, acked(7))
    io.producer = Producer()
    send(engine, 2, 3)
    assert core.replaced == 1 and core.backpressure == [2, 3] and not io.producer.callbacks
    send(engine, 2)
    io.producer.callbacks[0](None, acked(7))  # the topic was re-created under it, say: its offsets start again
    assert list(engine._deliveries) == [(1, None), (2, None)]
