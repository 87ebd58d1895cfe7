"""In-memory doubles of Kafka and the outbox table: run the real Harvester with no broker and no database.

    kafka, store = FakeKafka(), FakeStore()
    harvester = Harvester(config, connector=FakeConnector(kafka, store))

They are the in-memory world the deterministic simulator runs (outbox/kafka/memory/), on the
wall clock and with its faults off: a log per topic, a consumer group whose owner of partition 0
leads (the memory consumer and group, rebalance callbacks included), idempotent producers whose
delivery reports are served by poll(), either at once (auto_deliver) or when a test says so
(deliver()), and the outbox table with the engine's mark / purge / reset semantics and its fence.
Switches for failure tests:
`FakeKafka.refuse`, `heartbeats_lost`, `move_partition_zero()`, `lose_partition_zero()`;
`FakeStore.fail_marks`, `fail_purges`, `purge_gate`, `fence_holder`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import psycopg
from confluent_kafka import KafkaError, KafkaException

from outbox.harvest.contract import Record
from outbox.harvest.memory_table import MemoryStore, MemoryTable, Row
from outbox.harvest.neli import LeaderElection
from outbox.harvest.store import FenceHolder
from outbox.harvest.topics import TopicLimits
from outbox.kafka.memory.broker import MemoryBroker, MemoryProducer, StoredMessage
from outbox.kafka.memory.consumer import MemoryConsumer
from outbox.kafka.memory.groups import ConsumerGroup
from outbox.kafka.memory.world import LiveWorld
from outbox.kafka.sizes import UNLIMITED, batch_size_for

__all__ = ["FakeConnector", "FakeConsumer", "FakeKafka", "FakeMessage", "FakeProducer", "FakeStore", "Row"]

#: A message as the fakes store it: confluent_kafka.Message's accessors, and header(name).
FakeMessage = StoredMessage


class FakeKafka:
    """A broker: topic logs, the leader election's consumer group, and switches for failure tests."""

    #: The consumer group FakeConsumers join (one election per FakeKafka).
    GROUP = "leader"

    def __init__(self, *, auto_deliver: bool = True) -> None:
        self.world = LiveWorld()
        self.lock = self.world.lock
        self.broker = MemoryBroker(self.world, partitions=1)
        self.auto_deliver = auto_deliver
        #: While True, heartbeats never reach the leader topic (a network partition).
        self.heartbeats_lost = False
        self.record_producers: list[FakeProducer] = []
        self.consumers: list[FakeConsumer] = []
        #: (topic, key, value) -> exception for produce() to raise, or None: a record refused locally.
        self.refuse: Callable[[str, Any, Any], KafkaException | None] | None = None

    def messages(self, topic: str) -> list[StoredMessage]:
        with self.lock:
            self.world.run_due()
            return self.broker.messages(topic)

    def append(self, topic: str, key: Any, value: Any, headers: Any, partition: int = 0) -> StoredMessage:
        with self.lock:
            return self.broker.append(topic, partition, key, value, headers)

    @property
    def group(self) -> ConsumerGroup | None:
        """The leader election's group (none before the first consumer subscribed)."""
        return self.broker.consumer_groups.get(self.GROUP)

    @property
    def owner(self) -> FakeConsumer | None:
        """The consumer that owns partition 0 of the leader topic."""
        group = self.group
        held = group.owners.get((group.topics[0], 0)) if group is not None else None
        return next((c for c in self.consumers if c.member is held), None)

    def move_partition_zero(self, to: FakeConsumer | None = None) -> None:
        """Rebalance: the owner's on_revoke runs first; the new owner is assigned once it returns."""
        with self.lock:
            group = self.group
            if group is not None:
                group.move((group.topics[0], 0), to.member if to is not None else None)

    def lose_partition_zero(self) -> None:
        """The owner's session expires: its on_lost runs at its next poll; another member is assigned."""
        with self.lock:
            owner, group = self.owner, self.group
            if owner is not None and group is not None:
                group.expire(owner.member)


class FakeProducer(MemoryProducer):
    """confluent_kafka.Producer's produce / poll / flush / purge over FakeKafka."""

    def __init__(self, kafka: FakeKafka, *, heartbeats: bool = False) -> None:
        super().__init__(kafka.broker, "fake")
        self.kafka = kafka
        self.heartbeats = heartbeats
        self.hold = not heartbeats and not kafka.auto_deliver
        #: Everything handed to produce(), in order (whether or not it was delivered).
        self.produced: list[StoredMessage] = []

    def produce(self, topic: str, value: Any = None, key: Any = None, partition: int = -1,
                on_delivery: Callable[..., Any] | None = None, headers: Any = None, **_: Any) -> None:
        kafka = self.kafka
        if self.heartbeats and kafka.heartbeats_lost:
            return
        if kafka.refuse is not None and not self.heartbeats:
            error = kafka.refuse(topic, key, value)
            if error is not None:
                raise error
        with kafka.lock:
            super().produce(topic, value, key, partition, on_delivery, headers)
            self.produced.append(StoredMessage(topic, max(partition, 0), -1, key, value, headers))

    def deliver(self, count: int | None = None, error: KafkaError | None = None) -> int:
        """Acknowledge (or fail, with `error`) the oldest `count` messages held; served at the next poll()."""
        with self.kafka.lock:
            return self.release(count, error)

    def poll(self, timeout: float = 0) -> int:
        with self.kafka.lock:
            served = self._reporting
            self.world.run_due()
            served -= self._reporting
        if not served and timeout:
            threading.Event().wait(min(timeout, 0.005))
        return max(0, served)

    def flush(self, timeout: float = 0) -> int:
        self.poll(0)
        with self.kafka.lock:
            return len(self)

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True, **kwargs: Any) -> None:
        with self.kafka.lock:
            super().purge(in_queue, in_flight, blocking, **kwargs)

    def __len__(self) -> int:
        with self.kafka.lock:
            return super().__len__()


class FakeConsumer(MemoryConsumer):
    """confluent_kafka.Consumer over FakeKafka's leader group (the memory consumer the simulator runs). The
    rebalance callbacks run inside consume(), as librdkafka runs them inside poll(), outside the fakes' lock:
    a revoke may wait in its callback for the harvester to settle."""

    def __init__(self, kafka: FakeKafka, name: str = "consumer") -> None:
        super().__init__(kafka.broker, {"group.id": kafka.GROUP, "auto.offset.reset": "latest",
                                        "session.timeout.ms": 30_000}, name=name, alive=lambda: not self.closed)
        self.kafka = kafka
        #: How often consume() was called: a test that proves something does not happen waits on progress.
        self.polls = 0
        kafka.consumers.append(self)

    def subscribe(self, topics: list[str], on_assign: Any = None, on_revoke: Any = None, on_lost: Any = None) -> None:
        with self.kafka.lock:
            super().subscribe(topics, on_assign, on_revoke, on_lost)

    def consume(self, num_messages: int = 1, timeout: float | None = None) -> list[StoredMessage]:
        self.polls += 1
        with self.kafka.lock:
            self.world.run_due()
            return super().consume(num_messages, 0)

    def close(self) -> None:
        with self.kafka.lock:
            super().close()

    def _call(self, kind: str, partitions: list[tuple[str, int]]) -> None:
        lock = self.kafka.lock
        lock.release()  # held once, by consume() or close()
        try:
            super()._call(kind, partitions)
        finally:
            lock.acquire()


class FakeStore(MemoryStore):
    """The outbox table in memory, with the engine's mark / purge / reset semantics and the fence.

    Faults: `fail_marks` / `fail_purges` count down errors to raise. `fence_holder` set to a
    FenceHolder makes the fence taken by someone else.
    `purge_gate` set to a cleared Event makes purge() wait until it is set (a slow commit).
    """

    def __init__(self) -> None:
        self.world = LiveWorld()
        self.lock = self.world.lock
        super().__init__(MemoryTable(self.world), "fake", "fake")
        self.marks: list[list[int]] = []
        self.purged: list[int] = []
        self.resets: list[int] = []
        self.fail_marks = 0
        self.fail_purges = 0
        self.purge_gate: threading.Event | None = None
        self.fence_holder: FenceHolder | None = None
        self.fence_taken = False
        self.closed = False

    @property
    def rows(self) -> dict[int, Row]:
        return self.table.rows

    @property
    def dead_letters(self) -> list[tuple[Row, str]]:
        return self.table.dead_letters

    def add(self, topic: str, key: str, value: str | None = None, headers: Sequence[tuple[str, str]] = ()) -> int:
        """A committed INSERT, as stash() or a plain-SQL writer would make; returns its id."""
        with self.lock:
            row = self.table.insert(key, value, topic=topic, headers=headers, create_time=datetime.now(UTC))
            self.table.commit(row)
            self.world.run_due()
            return row.id

    def add_many(self, topic: str, keys: Sequence[str]) -> list[int]:
        return [self.add(topic, key, f"{key}-{i}") for i, key in enumerate(keys)]

    def update(self, row_id: int, **changes: Any) -> None:
        """Change a row as an operator's UPDATE would (its version changes)."""
        with self.lock:
            self.table.operator_update(row_id, **changes)

    # -- the Store protocol, with the switches ------------------------------------------------------

    def take_fence(self, *, end_stale: bool = True) -> FenceHolder | str | None:
        with self.lock:
            if self.fence_holder is not None:
                return self.fence_holder
            holder = super().take_fence(end_stale=end_stale)
            self.fence_taken = holder is None
            return holder

    def release_fence(self, *, settled: bool = True) -> None:
        with self.lock:
            super().release_fence(settled=settled)
            self.fence_taken = False

    def mark(self, limit: int, after: int,
             gaps: Sequence[tuple[int, int]] = ()) -> tuple[list[Record], frozenset[str] | None]:
        with self.lock:
            if self.fail_marks:
                self.fail_marks -= 1
                raise psycopg.OperationalError("injected mark failure")
            records, writers = super().mark(limit, after, gaps)
            self.marks.append([record.id for record in records])
            return records, writers

    def check_held(self, ids: Sequence[int]) -> dict[int, Record]:
        with self.lock:
            return super().check_held(ids)

    def park(self, record: Record, reason: str, attempts: int, parked_by: str, dead_letter_topic: str | None) -> bool:
        with self.lock:
            return super().park(record, reason, attempts, parked_by, dead_letter_topic)

    def purge(self, ids: Sequence[int], read_fence: bool = True, durable: bool = True) -> tuple[int, bool]:
        if self.purge_gate is not None:
            self.purge_gate.wait()
        with self.lock:
            if self.fail_purges:
                self.fail_purges -= 1
                raise psycopg.OperationalError("injected purge failure")
            self.purged.extend(ids)
            return super().purge(ids, read_fence, durable)

    def reset(self, ids: Sequence[int], errors: Sequence[str]) -> tuple[int, bool]:
        with self.lock:
            self.resets.extend(ids)
            return super().reset(ids, errors)

    def hold(self, record_id: int, reason: str) -> int | None:
        with self.lock:
            return super().hold(record_id, reason)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            super().close()


class FakeConnector:
    """A Connector over FakeKafka and FakeStore: `Harvester(config, connector=FakeConnector(kafka, store))`."""

    def __init__(self, kafka: FakeKafka | None = None, store: FakeStore | None = None) -> None:
        self.kafka = kafka if kafka is not None else FakeKafka()
        self.store = store if store is not None else FakeStore()
        self.leader_topic = "outbox-leader"
        self.batch_limit: int | None = None

    def open_store(self) -> FakeStore:
        return self.store

    def topic_limits(self) -> TopicLimits:
        """Topics' limits as FakeKafka's broker has them (`kafka.broker.max_message_bytes`)."""
        broker = self.kafka.broker

        def describe(topics: list[str]) -> dict[str, int | BaseException]:
            with self.kafka.lock:
                return {topic: broker.max_message_bytes.get(topic, UNLIMITED) for topic in topics}

        return TopicLimits(describe, refresh_interval=1.0)

    def ensure_leader_topic(self) -> None:
        pass

    def record_producer(self) -> FakeProducer:
        producer = FakeProducer(self.kafka)
        if self.batch_limit is not None and self.batch_limit < UNLIMITED:
            producer.batch_bytes = batch_size_for(self.batch_limit)
        with self.kafka.lock:
            self.kafka.record_producers.append(producer)
        return producer

    def dead_letter_producer(self) -> FakeProducer:
        return FakeProducer(self.kafka)

    def leader_election(self) -> LeaderElection:
        return LeaderElection(self.leader_topic, "fake", FakeConsumer(self.kafka),
                              FakeProducer(self.kafka, heartbeats=True))

    def listener(self, channel: str) -> None:
        return None

    def status_reporter(self, snapshot: Any, on_backlog: Any) -> None:
        return None
