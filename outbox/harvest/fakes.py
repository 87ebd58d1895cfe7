"""In-memory doubles of Kafka and the outbox table: run the real Harvester with no broker and no database.

    kafka, store = FakeKafka(), FakeStore()
    harvester = Harvester(config, connector=FakeConnector(kafka, store))

`FakeKafka` models what the engine relies on: a log per topic, one consumer group whose first
member owns partition 0 (rebalance callbacks included), and producers whose delivery reports
are served by poll(), either at once (auto_deliver) or when a test says so (deliver()).
`FakeStore` is the outbox table with mark / purge / reset semantics, the fence, and fault
injection. The engine's own tests use them; so can yours. (The deterministic simulator in
tests/sim/ models the same systems far more closely, with a simulated clock.)
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
from confluent_kafka import KafkaError, KafkaException

from outbox.harvest.contract import Record
from outbox.harvest.neli import LeaderElection
from outbox.harvest.store import FenceHolder


class FakeMessage:
    """The parts of confluent_kafka.Message the engine and tests read."""

    def __init__(self, topic: str, partition: int, offset: int, key: Any, value: Any,
                 headers: list[tuple[str, Any]] | None, error: KafkaError | None = None) -> None:
        self._topic, self._partition, self._offset = topic, partition, offset
        self._key, self._value, self._headers, self._error = key, value, headers, error

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self) -> Any:
        return self._key

    def value(self) -> Any:
        return self._value

    def headers(self) -> list[tuple[str, Any]] | None:
        return self._headers

    def error(self) -> KafkaError | None:
        return self._error

    def header(self, name: str) -> str | None:
        for key, value in self._headers or []:
            if key == name:
                return value.decode() if isinstance(value, bytes) else value
        return None


def _encode(value: Any) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


@dataclass
class FakePartition:
    """A TopicPartition as the rebalance callbacks see it."""

    topic: str
    partition: int = 0


class FakeKafka:
    """A broker: topic logs, one consumer group for partition 0, and switches for failure tests."""

    def __init__(self, *, auto_deliver: bool = True) -> None:
        self.lock = threading.RLock()
        self.logs: dict[str, list[FakeMessage]] = {}
        self.auto_deliver = auto_deliver
        #: While True, heartbeats never reach the leader topic (a network partition).
        self.heartbeats_lost = False
        self.record_producers: list[FakeProducer] = []
        self.members: list[FakeConsumer] = []
        self.owner: FakeConsumer | None = None
        #: (topic, key, value) -> exception for produce() to raise, or None: a record refused locally.
        self.refuse: Callable[[str, Any, Any], KafkaException | None] | None = None

    # -- the log --------------------------------------------------------------------------------

    def append(self, topic: str, key: Any, value: Any, headers: Any, partition: int = 0) -> FakeMessage:
        with self.lock:
            log = self.logs.setdefault(topic, [])
            message = FakeMessage(topic, partition, len(log), _encode(key), _encode(value),
                                  [(k, _encode(v)) for k, v in headers or []])
            log.append(message)
            return message

    def messages(self, topic: str) -> list[FakeMessage]:
        with self.lock:
            return list(self.logs.get(topic, []))

    # -- the group ------------------------------------------------------------------------------

    def join(self, member: FakeConsumer) -> None:
        with self.lock:
            self.members.append(member)
            if self.owner is None:
                self._assign(member)

    def _assign(self, member: FakeConsumer) -> None:
        self.owner = member
        member.events.append(("assign", len(self.logs.get(member.topic, []))))

    def move_partition_zero(self, to: FakeConsumer | None = None) -> None:
        """Rebalance: the owner's on_revoke runs first; the new owner is assigned once it returns."""
        with self.lock:
            if self.owner is not None:
                self.owner.events.append(("revoke", to))
            elif to is not None:
                self._assign(to)

    def lose_partition_zero(self) -> None:
        """The owner's session expired: on_lost, and nobody else is assigned until told."""
        with self.lock:
            if self.owner is not None:
                self.owner.events.append(("lost", None))
                self.owner = None

    def _revoked(self, member: FakeConsumer, successor: FakeConsumer | None) -> None:
        with self.lock:
            if self.owner is member:
                self.owner = None
                candidates = [m for m in self.members if m is not member and not m.closed]
                successor = successor or (candidates[0] if candidates else None)
                if successor is not None and successor is not member:
                    self._assign(successor)

    def leave(self, member: FakeConsumer) -> None:
        with self.lock:
            if member in self.members:
                self.members.remove(member)


class FakeProducer:
    """confluent_kafka.Producer's produce / poll / flush / purge, with delivery under the test's control."""

    def __init__(self, kafka: FakeKafka, *, heartbeats: bool = False) -> None:
        self.kafka = kafka
        self.heartbeats = heartbeats
        self.pending: deque[tuple[FakeMessage, Callable[..., Any] | None]] = deque()
        self._reports: deque[tuple[Callable[..., Any] | None, KafkaError | None, FakeMessage]] = deque()
        self.produced: list[FakeMessage] = []
        self._lock = threading.Lock()

    def produce(self, topic: str, value: Any = None, key: Any = None, partition: int = -1,
                on_delivery: Callable[..., Any] | None = None, headers: Any = None, **_: Any) -> None:
        if self.heartbeats:
            # Heartbeats land on the leader topic at once unless the network is "partitioned".
            if not self.kafka.heartbeats_lost:
                self.kafka.append(topic, key, value, headers, partition=0)
            return
        if self.kafka.refuse is not None:
            error = self.kafka.refuse(topic, key, value)
            if error is not None:
                raise error
        message = FakeMessage(topic, 0, -1, _encode(key), _encode(value), [(k, _encode(v)) for k, v in headers or []])
        with self._lock:
            self.produced.append(message)
            self.pending.append((message, on_delivery))

    def deliver(self, count: int | None = None, error: KafkaError | None = None) -> int:
        """Acknowledge (or fail, with `error`) the oldest `count` pending messages; served at the next poll()."""
        delivered = 0
        with self._lock:
            while self.pending and (count is None or delivered < count):
                message, callback = self.pending.popleft()
                if error is None:
                    message = self.kafka.append(message.topic(), message.key(), message.value(), message.headers())
                self._reports.append((callback, error, message))
                delivered += 1
        return delivered

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True) -> None:
        self.deliver(error=KafkaError(KafkaError._PURGE_QUEUE, "purged"))

    def poll(self, timeout: float = 0) -> int:
        if self.kafka.auto_deliver:
            self.deliver()
        served = 0
        while True:
            with self._lock:
                if not self._reports:
                    break
                callback, error, message = self._reports.popleft()
            if callback is not None:
                callback(error, message)
            served += 1
        if not served and timeout:
            threading.Event().wait(min(timeout, 0.005))
        return served

    def flush(self, timeout: float = 0) -> int:
        self.poll(0)
        return len(self.pending)

    def __len__(self) -> int:
        return len(self.pending) + len(self._reports)


class FakeConsumer:
    """confluent_kafka.Consumer's subscribe / consume / close for the leader topic."""

    def __init__(self, kafka: FakeKafka) -> None:
        self.kafka = kafka
        self.topic = ""
        self.events: deque[tuple[str, Any]] = deque()
        self.position: int | None = None
        self.closed = False
        self._callbacks: dict[str, Callable[..., Any] | None] = {}

    def subscribe(self, topics: list[str], on_assign: Any = None, on_revoke: Any = None, on_lost: Any = None) -> None:
        self.topic = topics[0]
        self._callbacks = {"assign": on_assign, "revoke": on_revoke, "lost": on_lost}
        self.kafka.join(self)

    def _serve_events(self) -> None:
        while self.events:
            kind, argument = self.events.popleft()
            callback = self._callbacks.get(kind)
            self.position = argument if kind == "assign" else None
            if callback is not None:
                callback(self, [FakePartition(self.topic, 0)])
            if kind == "revoke":
                self.kafka._revoked(self, argument)

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[FakeMessage]:
        self._serve_events()
        if self.position is None:
            return []
        log = self.kafka.messages(self.topic)
        batch = log[self.position:self.position + num_messages]
        self.position += len(batch)
        return batch

    def close(self) -> None:
        if self.closed:
            return
        if self.kafka.owner is self:
            self.events.append(("revoke", None))
        self._serve_events()
        self.closed = True
        self.kafka.leave(self)


@dataclass
class Row:
    id: int
    topic: str
    key: str
    value: str | None = None
    header_keys: tuple[str, ...] = ()
    header_values: tuple[str, ...] = ()
    leader_id: uuid.UUID | None = None
    create_time: datetime | None = None
    version: int = 1
    reset_count: int = 0
    last_error: str | None = None

    def record(self) -> Record:
        return Record(self.id, self.create_time, self.topic, self.key, self.value, list(self.header_keys),
                      list(self.header_values), self.leader_id, self.version)


class FakeStore:
    """The outbox table in memory, with the engine's mark / purge / reset semantics and the fence.

    Faults: `fail_marks` / `fail_purges` count down errors to raise; `mark_commits_before_error`
    makes a failing mark apply its UPDATE first, as a server can commit before the client sees a
    broken connection. `fence_holder` set to a FenceHolder makes the fence taken by someone else.
    """

    table_oid = 4242

    def __init__(self) -> None:
        self.rows: dict[int, Row] = {}
        self.dead_letters: list[tuple[Row, str]] = []
        self._ids = itertools.count(1)
        self._versions = itertools.count(2)
        self.lock = threading.Lock()
        self.marks: list[tuple[uuid.UUID, list[int]]] = []
        self.purged: list[int] = []
        self.resets: list[int] = []
        self.fail_marks = 0
        self.fail_purges = 0
        self.mark_commits_before_error = True
        #: When set to a cleared Event, purge() blocks until it is set (a slow commit).
        self.purge_gate: threading.Event | None = None
        #: Someone else's hold on the fence (None: free).
        self.fence_holder: FenceHolder | None = None
        self.fence_taken = False
        self.closed = False

    def add(self, topic: str, key: str, value: str | None = None, headers: Sequence[tuple[str, str]] = ()) -> int:
        with self.lock:
            row_id = next(self._ids)
            self.rows[row_id] = Row(row_id, topic, key, value, tuple(k for k, _ in headers),
                                    tuple(v for _, v in headers), create_time=datetime.now(UTC))
            return row_id

    def add_many(self, topic: str, keys: Sequence[str]) -> list[int]:
        return [self.add(topic, key, f"{key}-{i}") for i, key in enumerate(keys)]

    def update(self, row_id: int, **changes: Any) -> None:
        """Change a row as an operator's UPDATE would (its version changes)."""
        with self.lock:
            row = self.rows[row_id]
            for name, value in changes.items():
                setattr(row, name, value)
            row.version = next(self._versions)

    # -- the Store protocol ------------------------------------------------------------------------

    def take_fence(self) -> FenceHolder | None:
        with self.lock:
            if self.fence_holder is not None:
                return self.fence_holder
            self.fence_taken = True
            return None

    def release_fence(self) -> None:
        self.fence_taken = False

    def mark(self, leader_id: uuid.UUID, limit: int, after: int,
             upto: int | None = None) -> tuple[list[Record], tuple[int, int]]:
        with self.lock:
            top = upto if upto is not None else float("inf")
            chosen = [row for row_id, row in sorted(self.rows.items())
                      if after < row_id <= top and row.leader_id != leader_id][:limit]
            for row in chosen:
                row.leader_id = leader_id
                row.version = next(self._versions)
            if self.fail_marks:
                self.fail_marks -= 1
                if not self.mark_commits_before_error:
                    for row in chosen:
                        row.leader_id = None
                raise psycopg.OperationalError("injected mark failure")
            self.marks.append((leader_id, [row.id for row in chosen]))
            # Rows are committed the moment add() returns: no transaction is ever running.
            xid = next(self._versions)
            return sorted((row.record() for row in chosen), key=lambda r: r.id), (xid, xid)

    def check_held(self, ids: Sequence[int]) -> dict[int, Record]:
        with self.lock:
            return {i: self.rows[i].record() for i in ids if i in self.rows}

    def park(self, record: Record, reason: str, attempts: int, parked_by: str,
             dead_letter_topic: str | None) -> bool:
        with self.lock:
            row = self.rows.get(record.id)
            if row is None or row.leader_id != record.leader_id:
                return False
            del self.rows[record.id]
            self.dead_letters.append((row, reason))
            return True

    def purge(self, items: Sequence[tuple[int, uuid.UUID]]) -> tuple[int, bool]:
        if self.purge_gate is not None:
            self.purge_gate.wait()
        with self.lock:
            if self.fail_purges:
                self.fail_purges -= 1
                raise psycopg.OperationalError("injected purge failure")
            removed = 0
            for row_id, leader_id in items:
                row = self.rows.get(row_id)
                if row is not None and row.leader_id == leader_id:
                    del self.rows[row_id]
                    removed += 1
                self.purged.append(row_id)
            return removed, self.fence_taken

    def reset(self, items: Sequence[tuple[int, uuid.UUID]], errors: Sequence[str]) -> tuple[int, bool]:
        with self.lock:
            count = 0
            for (row_id, leader_id), error in zip(items, errors, strict=True):
                row = self.rows.get(row_id)
                if row is not None and row.leader_id == leader_id:
                    row.leader_id = None
                    row.reset_count += 1
                    row.last_error = error
                    row.version = next(self._versions)
                    count += 1
                self.resets.append(row_id)
            return count, self.fence_taken

    def hold(self, record_id: int, leader_id: uuid.UUID, reason: str) -> int | None:
        with self.lock:
            row = self.rows.get(record_id)
            if row is None or row.leader_id != leader_id:
                return None
            row.reset_count += 1
            row.last_error = reason
            row.version = next(self._versions)
            return row.version

    def has_notify_trigger(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


class FakeConnector:
    """A Connector over FakeKafka and FakeStore: `Harvester(config, connector=FakeConnector(kafka, store))`."""

    def __init__(self, kafka: FakeKafka | None = None, store: FakeStore | None = None) -> None:
        self.kafka = kafka if kafka is not None else FakeKafka()
        self.store = store if store is not None else FakeStore()
        self.leader_topic = "outbox-leader"

    def open_store(self) -> FakeStore:
        return self.store

    def ensure_leader_topic(self) -> None:
        pass

    def record_producer(self) -> FakeProducer:
        producer = FakeProducer(self.kafka)
        with self.kafka.lock:
            self.kafka.record_producers.append(producer)
        return producer

    def dead_letter_producer(self) -> FakeProducer:
        return FakeProducer(self.kafka)

    def leader_election(self) -> LeaderElection:
        return LeaderElection(self.leader_topic, "fake", FakeConsumer(self.kafka), FakeProducer(self.kafka,
                                                                                                  heartbeats=True))

    def listener(self, channel: str) -> None:
        return None

    def status_reporter(self, snapshot: Any, on_backlog: Any) -> None:
        return None

