"""The driver's side of tracing, without Kafka: every record a Send traces gets one handle, settled
exactly once, whichever way its Send goes (acknowledged, never produced, refused, waiting for its
topic's limit), so no batch span is left open or ended early."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from outbox.harvest import commands as cmd
from outbox.harvest.contract import Record
from outbox.harvest.driver import Driver

UNLIMITED = 10**9


class Acked:
    """A report of delivery: each record at an offset of its own, as Kafka writes them."""

    def __init__(self, topic: str, offset: int) -> None:
        self._topic, self._offset = topic, offset

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset


class Producer:
    """Keeps each delivery callback; raises `fail_at`'s error at that call of produce()."""

    def __init__(self, fail_at: int | None = None, error: Exception | None = None) -> None:
        self.callbacks: list[Any] = []
        self.fail_at, self.error, self.calls = fail_at, error, 0

    def produce(self, topic: str, value: Any = None, key: Any = None, headers: Any = None,
                on_delivery: Any = None) -> None:
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            assert self.error is not None
            raise self.error
        self.callbacks.append((topic, on_delivery))

    def acknowledge_all(self) -> None:
        for offset, (topic, callback) in enumerate(self.callbacks):
            callback(None, Acked(topic, offset))
        self.callbacks.clear()


class IO:
    batch_limit = UNLIMITED

    def __init__(self, producer: Producer, limits: dict[str, int | None]) -> None:
        self.producer, self.limits = producer, limits

    def topic_limit_stale(self, topic: str) -> bool:
        return False

    def topic_limit(self, topic: str) -> int | None:
        return self.limits.get(topic, UNLIMITED)

    def fit_batches(self, smallest: int) -> bool:
        return True

    def refused_for_size(self, topic: str | None) -> None:
        pass


class Core:
    def __init__(self) -> None:
        self.backpressure: list[int] = []
        self.refused: list[int] = []
        self.producer_failed = False

    def on_backpressure(self, ids: list[int]) -> None:
        self.backpressure.extend(ids)

    def on_refused(self, record_id: int, failure: Any) -> None:
        self.refused.append(record_id)

    def on_producer_failed(self, failure: Any) -> None:
        self.producer_failed = True


class SpyTracer:
    """A handle per record (its id); counts how each is settled."""

    def __init__(self) -> None:
        self.traced: list[int] = []
        self.settled: Counter[int] = Counter()
        self.failed_ids: list[int] = []

    def sending(self, records: Any) -> list[int]:
        self.traced.extend(r.id for r in records)
        return [r.id for r in records]

    def acknowledged(self, handle: int, message: Any) -> None:
        self.settled[handle] += 1

    def failed(self, handle: int, record_id: int, error: Any) -> None:
        assert handle == record_id
        self.failed_ids.append(record_id)

    def held(self, handle: int, record_id: int, reason: str) -> None:
        pass

    def end(self, handle: int) -> None:
        self.settled[handle] += 1

    def parked(self, *args: Any) -> None:
        pass


def records(count: int, topic: str = "orders") -> tuple[Record, ...]:
    now = datetime.now(UTC)
    return tuple(Record(i, now, topic, f"k{i}", "v", ["traceparent"], [f"00-{i + 1:032x}-{i + 1:016x}-01"])
                 for i in range(1, count + 1))


def driver(producer: Producer, limits: dict[str, int | None] | None = None) -> tuple[Driver, Core, SpyTracer]:
    core, tracer = Core(), SpyTracer()
    engine = Driver(core, IO(producer, limits or {}), tracer=tracer)  # type: ignore[arg-type]
    engine.wake = lambda: None
    return engine, core, tracer


def test_every_acknowledged_record_settles_its_handle_once():
    producer = Producer()
    engine, _, tracer = driver(producer)
    engine._send(cmd.Send(records(50)))
    assert not tracer.settled
    producer.acknowledge_all()
    assert tracer.traced == list(range(1, 51)) and tracer.settled == Counter(range(1, 51))


def test_records_of_a_topic_whose_limit_is_being_read_are_not_traced_and_the_rest_are():
    producer = Producer()
    engine, core, tracer = driver(producer, {"slow": None})
    batch = records(4) + tuple(Record(r.id + 10, r.create_time, "slow", r.key, r.value) for r in records(3))
    engine._send(cmd.Send(batch))
    assert tracer.traced == [1, 2, 3, 4] and core.backpressure == [11, 12, 13]
    producer.acknowledge_all()
    assert tracer.settled == Counter([1, 2, 3, 4])


def test_a_full_local_queue_ends_the_handles_of_every_record_not_produced():
    producer = Producer(fail_at=3, error=BufferError("queue full"))
    engine, core, tracer = driver(producer)
    engine._send(cmd.Send(records(6)))
    assert core.backpressure == [4, 5, 6]
    assert tracer.settled == Counter([4, 5, 6]), "the unsent end now, the produced ones wait for their reports"
    producer.acknowledge_all()
    assert tracer.settled == Counter(range(1, 7))


def test_a_fatal_producer_error_fails_its_record_and_ends_the_rest():
    producer = Producer(fail_at=2, error=KafkaException(KafkaError(KafkaError._FATAL, "fenced", fatal=True)))
    engine, core, tracer = driver(producer)
    engine._send(cmd.Send(records(5)))
    assert core.producer_failed and tracer.failed_ids == [3]
    assert tracer.settled == Counter([4, 5]), "record 3 ends after the turn (a Hold may follow), 4 and 5 now"
    assert engine._turn_failures == {3: 3}
    producer.acknowledge_all()
    assert tracer.settled == Counter([1, 2, 4, 5])
