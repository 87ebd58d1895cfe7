"""Kafka in memory: topic logs, idempotent producers, and the brokers' consumer groups.

What the harvester relies on, and what goes wrong with it, is modelled; the wire is not:
- a producer has confluent-kafka's interface (produce, poll, flush, purge, len); its delivery
  reports carry real KafkaErrors and are served a little later, as poll() would serve them;
- it writes each partition in sequence: the broker appends a batch only if it is the next one
  expected from that producer session (so a partition's log holds a prefix of what was sent),
  refuses a whole batch that holds a poison record (the producer itself refuses a huge one at
  produce()) or that is larger than its topic's `max_message_bytes` (a producer's batches are at most
  its `batch_bytes`, as librdkafka's batch.size), may lose a batch's acknowledgement (the batch is
  written; librdkafka retries it and the broker answers "duplicate", with the offsets it wrote it
  at), or fails it for a while;
- like Kafka, it takes a producer's first batch to a partition whatever its sequence, so a batch
  after one that failed for a moment can be written first, and the earlier one's retry is then
  answered "duplicate" at no offset, though it was never written (acks.py); with `seq_lost` the
  producer forgets a partition's sequence and numbers new records from 0 again, which the broker
  takes for duplicates of what it wrote first (it answers with those records' offsets and writes
  nothing: the harvester must not take either for delivery);
- with `gapless` (several records of a key in flight) a refused batch is a fatal error: nothing
  after it is written, and every record in the producer fails; without it (one in flight per key),
  librdkafka's own delivery timeout fails records, queued ones unwritten, in-flight ones perhaps
  written;
- purging a producer fails everything in it at once; batches already on the wire land or not,
  decided at that moment (a modelling simplification);
- a transaction's records take their offsets when produced and become visible to read_committed
  consumers when it commits (transactions.py); a partition's last stable offset stops at the first
  record of a transaction still open; every message has a timestamp (the broker's append time for
  topics created with `log_append_time`, as the queue's markers topic is);
- consumer groups (the leader elections' and the queues', with their coordinator, offsets, generations and
  rebalances) are groups.py's, one model for all of them.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import TIMESTAMP_CREATE_TIME, TIMESTAMP_LOG_APPEND_TIME, KafkaError, KafkaException

from outbox.kafka.headers import HEADER_ID
from outbox.kafka.memory.groups import ConsumerGroup
from outbox.kafka.memory.world import World
from outbox.kafka.sizes import RECORD_BATCH_OVERHEAD, record_size

PERMANENT = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "Broker: Message size too large")
TIMED_OUT = KafkaError(KafkaError._MSG_TIMED_OUT, "Local: Message timed out", retriable=True)
PURGED = KafkaError(KafkaError._PURGE_QUEUE, "Local: Purged in queue")
FATAL = KafkaError(KafkaError._FATAL, "Local: Fatal error", fatal=True)
FENCED = KafkaError(KafkaError.PRODUCER_FENCED, "Broker: producer fenced", fatal=True)
#: The brokers' wall clock at the world's time 0 (2026-01-01 UTC), for message timestamps.
BROKER_EPOCH = 1_767_225_600.0

#: A value the broker refuses (as it would a record over its topic's size limit)...
POISON = "POISON"
#: ...and one the producer refuses before it leaves the process (over the producer's own limit).
HUGE = "HUGE"
POISONS = frozenset({POISON, HUGE})


def batch_size(messages: list[Pending]) -> int:
    """A batch's size as the broker measures it (record format v2, uncompressed)."""
    return RECORD_BATCH_OVERHEAD + sum(record_size(m.key, m.value, m.headers or ()) - RECORD_BATCH_OVERHEAD
                                       for m in messages)


def _encode(value: Any) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


class StoredMessage:
    """A message in a topic's log, with confluent_kafka.Message's accessors."""

    __slots__ = ("_error", "_headers", "_key", "_offset", "_partition", "_timestamp_type", "_topic", "_value",
                 "control", "producer", "record_id", "replica", "time", "txn")

    def __init__(self, topic: str, partition: int, offset: int, key: Any, value: Any, headers: Any,
                 *, producer: int = 0, replica: str = "", time: float = 0.0, error: KafkaError | None = None,
                 txn: Any = None, control: bool = False, log_append_time: bool = False) -> None:
        self._topic, self._partition, self._offset = topic, partition, offset
        self._key, self._value = _encode(key), _encode(value)
        self._headers = [(k, _encode(v)) for k, v in headers or []]
        self._error = error
        self.producer, self.replica, self.time = producer, replica, time
        #: The transaction that wrote it (transactions.Transaction), None outside one.
        self.txn = txn
        #: A transaction's commit or abort marker: takes an offset, never returned to a consumer.
        self.control = control
        self._timestamp_type = TIMESTAMP_LOG_APPEND_TIME if log_append_time else TIMESTAMP_CREATE_TIME
        found = self.header(HEADER_ID)
        #: The outbox id the harvester put in its header (None for messages that have none).
        self.record_id = int(found) if found is not None else None

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def headers(self) -> list[tuple[str, bytes | None]]:
        return self._headers

    def error(self) -> KafkaError | None:
        return self._error

    def timestamp(self) -> tuple[int, int]:
        """(type, milliseconds since the epoch): the time it was appended (or produced: the same here)."""
        return self._timestamp_type, round((BROKER_EPOCH + self.time) * 1000)

    @property
    def aborted(self) -> bool:
        return self.txn is not None and self.txn.state == "aborted"

    def header(self, name: str) -> str | None:
        """The first header of that name, as text."""
        for key, value in self._headers:
            if key == name:
                return value.decode() if isinstance(value, bytes) else value
        return None

    @property
    def key_text(self) -> str:
        return (self._key or b"").decode()


#: librdkafka's offset of a message whose offset is not known.
OFFSET_INVALID = -1001


@dataclass
class ProducerFaults:
    transient: float = 0.0  # a batch is not written this time (retried)
    ack_lost: float = 0.0  # a batch is written but its acknowledgement lost (retried: duplicate)
    fatal: float = 0.0  # the producer fails fatally at a batch
    seq_lost: float = 0.0  # the producer numbers a partition's next batch from 0 again (acks.py)
    latency: tuple[float, float] = (0.0005, 0.004)


@dataclass(eq=False)
class Pending:
    """A message handed to a producer, not yet reported."""

    topic: str
    partition: int
    key: Any
    value: Any
    headers: Any
    enqueued: float
    on_report: Callable[[KafkaError | None, Any], None]
    seq: int = -1
    state: str = "queued"  # queued, inflight, done
    offset: int = OFFSET_INVALID  # where the broker says it is (a duplicate: where it wrote that number)


class Report:
    """What a delivery report hands the callback: confluent_kafka.Message's accessors of a Pending."""

    __slots__ = ("_pending",)

    def __init__(self, pending: Pending) -> None:
        self._pending = pending

    def topic(self) -> str:
        return self._pending.topic

    def partition(self) -> int:
        return self._pending.partition

    def offset(self) -> int:
        return self._pending.offset


@dataclass(eq=False)
class Batch:
    messages: list[Pending]
    topic: str
    partition: int
    first_seq: int
    epoch: int


class MemoryBroker:
    """The brokers: topic logs, producer sessions' sequence numbers, consumer groups."""

    def __init__(self, world: World, *, partitions: int = 3, faults: ProducerFaults | None = None) -> None:
        self.world = world
        self.partitions = partitions  # of a topic created by its first message
        self.faults = faults or ProducerFaults()
        self.topics: dict[str, list[list[StoredMessage]]] = {}
        #: Outbox ids of every record written, whatever its topic.
        self.published: set[int] = set()
        self._producer_ids = 0
        #: (producer id, epoch, topic, partition) -> next expected sequence
        self._expected: dict[tuple[int, int, str, int], int] = {}
        #: (producer id, epoch, topic, partition) -> {sequence: offset it was written at}
        self._written_at: dict[tuple[int, int, str, int], dict[int, int]] = {}
        self._fenced_epochs: dict[int, int] = {}
        #: Topics' max.message.bytes (a topic not named here takes any batch).
        self.max_message_bytes: dict[str, int] = {}
        #: When a batch was refused for its size, and its topic.
        self.size_refusals: list[tuple[float, str]] = []
        #: Consumer groups (groups.py), by group id.
        self.consumer_groups: dict[str, ConsumerGroup] = {}
        #: Share groups (share_groups.py), by group id.
        self.share_groups: dict[str, Any] = {}
        #: Topics whose timestamps are the broker's append time (message.timestamp.type=LogAppendTime).
        self.log_append_time: set[str] = set()
        #: (topic, partition) -> {open transaction: offset of its first record there}.
        self.open_transactions: dict[tuple[str, int], dict[Any, int]] = {}
        #: Told what becomes visible and what offsets groups commit (the simulator's checks).
        self.watchers: list[Any] = []
        #: Transactions left open this long are aborted by the broker (None: each producer's transaction.timeout.ms).
        self.transaction_timeout: float | None = None
        #: Until then no transaction coordinator answers (a broker restarting): transactions.py.
        self.coordinator_down_until = 0.0
        #: transactional.id -> the producer that last started transactions with it (the others are fenced).
        self.transactional_ids: dict[str, Any] = {}

    def log(self, topic: str, partitions: int | None = None) -> list[list[StoredMessage]]:
        """A topic's partitions (created, empty, when first asked for)."""
        if topic not in self.topics:
            self.topics[topic] = [[] for _ in range(partitions or self.partitions)]
        return self.topics[topic]

    def messages(self, topic: str) -> list[StoredMessage]:
        """A topic's messages, partition by partition."""
        return [message for partition in self.topics.get(topic, []) for message in partition]

    def create_topic(self, topic: str, partitions: int, *, log_append_time: bool = False) -> None:
        self.log(topic, partitions)
        if log_append_time:
            self.log_append_time.add(topic)

    def stable_end(self, topic: str, partition: int) -> int:
        """The last stable offset: read_committed consumers read no further (an open transaction's first record)."""
        opened = self.open_transactions.get((topic, partition))
        return min(opened.values()) if opened else len(self.log(topic)[partition])

    def partition_of(self, topic: str, key: Any) -> int:
        return zlib.crc32(_encode(key) or b"") % len(self.log(topic))

    def new_producer_id(self) -> int:
        self._producer_ids += 1
        return self._producer_ids

    def consumer_group(self, name: str, topics: list[str], session_timeout: float,
                       move_chance: float = 0.0) -> ConsumerGroup:
        """The group `name` (made by the first member to subscribe, for the topics it subscribes to)."""
        if name not in self.consumer_groups:
            self.consumer_groups[name] = ConsumerGroup(self.world, self, name, topics, session_timeout, move_chance)
        return self.consumer_groups[name]

    def append(self, topic: str, partition: int, key: Any, value: Any, headers: Any, *, producer: int = 0,
               replica: str = "", txn: Any = None, control: bool = False) -> StoredMessage:
        log = self.log(topic)[partition]
        message = StoredMessage(topic, partition, len(log), key, value, headers, producer=producer, replica=replica,
                                time=self.world.now, txn=txn, control=control,
                                log_append_time=topic in self.log_append_time)
        log.append(message)
        if message.record_id is not None:
            self.published.add(message.record_id)
        if txn is None and not control and self.watchers:
            for watcher in self.watchers:
                watcher.visible([message])
        return message

    def accept(self, producer: MemoryProducer, batch: Batch) -> str:
        """The broker's decision for a batch: 'written', 'duplicate', 'out_of_order', 'refused', 'fenced'."""
        if batch.epoch < self._fenced_epochs.get(producer.id, 0):
            return "fenced"
        if any(m.value == POISON for m in batch.messages):
            return "refused"
        limit = self.max_message_bytes.get(batch.topic)
        if limit is not None and batch_size(batch.messages) > limit:
            self.size_refusals.append((self.world.now, batch.topic))
            return "refused"
        key = (producer.id, batch.epoch, batch.topic, batch.partition)
        # Kafka keeps no state of a producer that has written nothing to the partition yet, and takes its
        # first batch whatever its sequence: a batch after one that failed for a moment can land first.
        expected = self._expected.get(key, batch.first_seq)
        if batch.first_seq > expected:
            return "out_of_order"
        written_at = self._written_at.setdefault(key, {})
        if batch.first_seq < expected:
            for message in batch.messages:  # answered with where those numbers were written
                message.offset = written_at.get(message.seq, OFFSET_INVALID)
            return "duplicate"
        self._expected[key] = expected + len(batch.messages)
        self._fenced_epochs[producer.id] = batch.epoch
        for message in batch.messages:
            stored = self.append(batch.topic, batch.partition, message.key, message.value, message.headers,
                                 producer=producer.id, replica=producer.replica)
            message.offset = written_at[message.seq] = stored.offset()
        return "written"


class MemoryProducer:
    """One librdkafka producer instance (one idempotent producer id), with confluent-kafka's interface."""

    def __init__(self, broker: MemoryBroker, replica: str = "", *, gapless: bool = False,
                 delivery_timeout: float | None = None, is_running: Callable[[], bool] = lambda: True,
                 can_reach: Callable[[], bool] = lambda: True) -> None:
        self.broker = broker
        self.world = broker.world
        self.id = broker.new_producer_id()
        self.replica = replica
        self.gapless = gapless
        self.delivery_timeout = delivery_timeout  # None: librdkafka never times out on its own
        self._is_running = is_running
        self.can_reach = can_reach
        #: While True, nothing is transmitted until release() (a test's control over acknowledgements).
        self.hold = False
        #: librdkafka's batch.size: a batch holds its first message and more only while they fit.
        self.batch_bytes: int | None = None
        self.epoch = 0
        self.queues: dict[tuple[str, int], deque[Pending]] = {}
        self.inflight: dict[tuple[str, int], deque[Batch]] = {}
        self._next_seq: dict[tuple[str, int], int] = {}
        self.failed_fatally = False
        self.closed = False
        self._pumping = False
        self._reporting = 0  # reports decided, not yet served (librdkafka counts them in len())

    # -- confluent-kafka's interface ---------------------------------------------------------------

    def __len__(self) -> int:
        return self.outstanding() + self._reporting

    def produce(self, topic: str, value: Any = None, key: Any = None, partition: int = -1,
                on_delivery: Callable[[KafkaError | None, Any], None] | None = None, headers: Any = None,
                **_: Any) -> None:
        if value == HUGE:
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "Broker: Message size too large"))
        chosen = partition if partition >= 0 else self.broker.partition_of(topic, key)
        message = Pending(topic, chosen, key, value, headers, self.world.now, on_delivery or (lambda *_: None))
        if self.failed_fatally:
            self._report(message, FATAL)
            return
        self.queues.setdefault((topic, chosen), deque()).append(message)
        self._schedule_pump(0.0)

    def poll(self, timeout: float = 0) -> int:
        return 0  # reports are served by the world's clock

    def flush(self, timeout: float = 0) -> int:
        return len(self)

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True, *,
              error: KafkaError = PURGED) -> None:
        """Fail everything: queued records unwritten; batches on the wire land or not, now."""
        for queue in self.queues.values():
            while queue:
                self._report(queue.popleft(), error)
        for inflight in self.inflight.values():
            while inflight:
                batch = inflight.popleft()
                self._resolve_now(batch)
                for message in batch.messages:
                    self._report(message, error)
        self.epoch += 1
        self._next_seq = {}

    def close(self) -> None:
        self.closed = True

    # -- the model -------------------------------------------------------------------------------

    def outstanding(self) -> int:
        return sum(len(q) for q in self.queues.values()) + sum(
            len(b.messages) for batches in self.inflight.values() for b in batches)

    def release(self, count: int | None = None, error: KafkaError | None = None) -> int:
        """With `hold`: acknowledge (or fail with `error`) the oldest `count` queued messages, in order."""
        released = 0
        for where, queue in self.queues.items():
            while queue and (count is None or released < count):
                message = queue.popleft()
                if error is None:
                    message.offset = self.broker.append(where[0], where[1], message.key, message.value,
                                                        message.headers, producer=self.id,
                                                        replica=self.replica).offset()
                self._report(message, error)
                released += 1
        return released

    def _schedule_pump(self, delay: float) -> None:
        if not self._pumping and not self.closed and not self.hold:
            self._pumping = True
            self.world.after(delay, self._pump)

    def _pump(self) -> None:
        """librdkafka's broker threads: time out, then transmit what can go (a process paused sends nothing)."""
        self._pumping = False
        if self.closed or self.hold:
            return
        if not self._is_running():
            self._schedule_pump(0.05)
            return
        self._expire()
        busy = False
        for where, queue in self.queues.items():
            if not queue:
                continue
            busy = True
            inflight = self.inflight.setdefault(where, deque())
            if len(inflight) >= 5 or not self.can_reach():
                continue
            count = min(len(queue), self.world.rng.randint(1, 8))
            messages = [queue.popleft()]
            while len(messages) < count and (self.batch_bytes is None
                                             or batch_size([*messages, queue[0]]) <= self.batch_bytes):
                messages.append(queue.popleft())
            faults = self.broker.faults
            if faults.seq_lost and self.world.chance(faults.seq_lost):
                self._next_seq.pop(where, None)  # librdkafka's state of the partition lost: numbered from 0
            seq = self._next_seq.get(where, 0)
            for i, message in enumerate(messages):
                if message.seq < 0:
                    message.seq = seq + i
            first = messages[0].seq
            self._next_seq[where] = max(self._next_seq.get(where, 0), messages[-1].seq + 1)
            for message in messages:
                message.state = "inflight"
            batch = Batch(messages, where[0], where[1], first, self.epoch)
            inflight.append(batch)
            self.world.after(self.world.latency(*self.broker.faults.latency), lambda b=batch: self._arrive(b))
        if busy:
            self._schedule_pump(0.002)

    def _arrive(self, batch: Batch) -> None:
        """The batch reaches the partition leader."""
        if self.closed or batch not in self.inflight.get((batch.topic, batch.partition), ()):
            return
        if not self.can_reach():
            self._retry(batch, 0.05)
            return
        faults = self.broker.faults
        if self.world.chance(faults.transient):
            self._retry(batch, 0.01)
            return
        if self.world.chance(faults.fatal):
            self._fatal(batch, FATAL)
            return
        verdict = self.broker.accept(self, batch)
        if verdict == "out_of_order":
            self._retry(batch, 0.005)
            return
        if verdict == "refused":
            if self.gapless:
                self._fatal(batch, PERMANENT)
            else:
                self._finish(batch, PERMANENT)
                self._bump_epoch()
            return
        if verdict == "fenced":
            self._finish(batch, FENCED)
            return
        if verdict == "written" and self.world.chance(faults.ack_lost):
            self._retry(batch, 0.05)  # written; the retry will come back "duplicate"
            return
        self.world.after(self.world.latency(*faults.latency), lambda: self._finish(batch, None))

    def _retry(self, batch: Batch, delay: float) -> None:
        self.world.after(delay, lambda: self._arrive(batch))

    def _finish(self, batch: Batch, error: KafkaError | None) -> None:
        inflight = self.inflight.get((batch.topic, batch.partition))
        if inflight is None or batch not in inflight:
            return
        inflight.remove(batch)
        for message in batch.messages:
            self._report(message, error)
        self._schedule_pump(0.0)

    def _report(self, message: Pending, error: KafkaError | None) -> None:
        if message.state == "done":
            return
        message.state = "done"
        self._reporting += 1

        def serve() -> None:
            self._reporting -= 1
            message.on_report(error, Report(message))
        # Delivery reports reach the application through poll(): later, never at once.
        self.world.after(self.world.latency(0.0002, 0.002), serve)

    def _bump_epoch(self) -> None:
        """After a failure librdkafka drains the partition and restarts its sequence (a gap is possible)."""
        self.epoch += 1
        for queue in self.queues.values():
            for message in queue:
                message.seq = -1
        self._next_seq = {}

    def _expire(self) -> None:
        """librdkafka's own message timeout (only with one record per key in flight)."""
        if self.delivery_timeout is None:
            return
        deadline = self.world.now - self.delivery_timeout
        for where, queue in self.queues.items():
            expired_any = False
            while queue and queue[0].enqueued < deadline:
                self._report(queue.popleft(), TIMED_OUT)
                expired_any = True
            inflight = self.inflight.get(where, deque())
            for batch in list(inflight):
                if batch.messages[0].enqueued < deadline:
                    inflight.remove(batch)
                    self._resolve_now(batch)
                    for message in batch.messages:
                        self._report(message, TIMED_OUT)
                    expired_any = True
            if expired_any:
                self._bump_epoch()

    def _resolve_now(self, batch: Batch) -> None:
        """A batch on the wire when it was given up: it lands or not, decided now."""
        if self.can_reach() and self.world.chance(0.5):
            self.broker.accept(self, batch)

    def _fatal(self, at: Batch, error: KafkaError) -> None:
        self.failed_fatally = True
        inflight = self.inflight.get((at.topic, at.partition))
        if inflight is not None and at in inflight:
            inflight.remove(at)
            for message in at.messages:
                self._report(message, error)
        self.purge(error=FATAL)
