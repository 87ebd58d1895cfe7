"""The redelivery tracker: reads the markers topic and redelivers what no consumer finished.

    tracker = RedeliveryTracker(config, dead_letters=store_dead_letters)
    tracker.start()        # QueueError with a one-line reason; cleans up on failure
    tracker.stop()         # returns at once
    tracker.wait()         # blocks until stopped; re-raises a background failure

Any number of replicas share the markers topic's partitions through one consumer group; each
rebuilds the state of the partitions it is given from the log (tracker_state.py), starting at the
offset committed for them: the oldest Start marker still in progress.

A message whose deadline passed is redelivered to the queue topic together with the End marker
that closes its old delivery, in one Kafka transaction that also commits the tracker's offsets.
So a tracker killed at any moment either redelivered the message and recorded it, or did
neither: the replica that takes over never redelivers it a second time (kafka-mq-go's scenario
2, and more: its End marker was a separate write). The offsets sent with the transaction carry
the consumer group's generation, which fences a tracker that lost the partition meanwhile.

A message delivered max_deliveries times is handed to the dead-letter sink instead (the Django
app stores it in a table), then ended the same way; the sink must be idempotent per message id.

A broker restart ends no tracker: a redelivery that fails is tried again after RETRY_BACKOFF, and a
transactional producer that fails for good is replaced by one with the same transactional id
(transactional.py), whose start settles what the old one left open; the End markers in the log then
say what was redelivered. While it waits it says so once (`waiting_for()`).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from outbox.kafka.clients import KAFKA_START_TIMEOUT, KafkaUnavailable
from outbox.kafka.names import default_name
from outbox.kafka.outage import Outage
from outbox.queue import clients, markers
from outbox.queue.config import QueueConfig
from outbox.queue.errors import QueueError
from outbox.queue.instruments import QueueInstruments
from outbox.queue.markers import Kind, Marker, MarkerError
from outbox.queue.topics import ensure_topics
from outbox.queue.tracker_state import Due, PartitionTracker, QueueStats
from outbox.queue.transactional import Caller, TransactionalWriter, call_with_deadline
from outbox.reasons import first_line, kafka_reason

log = logging.getLogger(__name__)

#: Markers read per poll.
FETCH_BATCH = 1000
#: The tracker's offsets are committed this often (and with every redelivery).
COMMIT_INTERVAL = 1.0
#: A failed redelivery or dead-lettering is tried again this much later (deadline clock).
RETRY_BACKOFF = 1.0
#: The snapshot (status rows, metrics) is refreshed this often.
SNAPSHOT_INTERVAL = 0.5
#: A commit that is waited for (on a revoke, when stopping) gives up after this many seconds: librdkafka's
#: synchronous commit has no timeout, and a coordinator lost in a broker's restart may never answer it.
COMMIT_TIMEOUT = 10.0
#: Closing the markers consumer (leaving the group) gives up after this many seconds, for the same reason.
CLOSE_TIMEOUT = 30.0


@dataclass(frozen=True)
class DeadLetter:
    """A message that reached its max deliveries, for the dead-letter sink."""

    queue: str
    message_id: str
    key: bytes | None
    payload: bytes | None
    #: The application's headers (the queue's own mq- headers removed).
    headers: list[tuple[str, bytes]]
    deliveries: int
    #: When its last delivery started (seconds since the epoch, the markers' clock).
    started: float


DeadLetterSink = Callable[[Sequence[DeadLetter]], None]


@dataclass
class TrackerSnapshot:
    """What a tracker knows, for status rows and metrics; refreshed by the tracker thread."""

    partitions: list[int] = field(default_factory=list)
    queues: dict[str, QueueStats] = field(default_factory=dict)
    #: Totals since start, per queue.
    redelivered: dict[str, int] = field(default_factory=dict)
    dead_lettered: dict[str, int] = field(default_factory=dict)
    #: Partitions still rebuilding their state from the log (not yet read to the end once).
    replaying: list[int] = field(default_factory=list)
    #: Start and End markers read since start, per queue (a replay after a rebalance reads some again).
    starts: dict[str, int] = field(default_factory=dict)
    ends: dict[str, int] = field(default_factory=dict)


class State(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    STOPPED = "stopped"


class RedeliveryTracker:
    """One replica of the redelivery tracker."""

    #: Markers read at most per round (the simulator lowers it, so replays take several rounds).
    fetch_batch = FETCH_BATCH

    def __init__(self, config: QueueConfig, *, dead_letters: DeadLetterSink, name: str | None = None,
                 instruments: QueueInstruments | None = None,
                 consumer_factory: Callable[[dict[str, Any]], Any] = Consumer,
                 producer_factory: Callable[[dict[str, Any]], Any] = Producer,
                 clock: Callable[[], float] = time.monotonic,
                 create_topics: Callable[[QueueConfig, float], int | None] = ensure_topics,
                 caller: Caller = call_with_deadline) -> None:
        """`caller`: how a call into librdkafka that may hang is made (transactional.py; the simulator's never do)."""
        self.config = config
        self.name = name or default_name()
        self._dead_letters = dead_letters
        self._instruments = instruments or QueueInstruments()
        self._consumer_factory, self._producer_factory, self._clock = consumer_factory, producer_factory, clock
        self._create_topics = create_topics
        self._call = caller
        self.state = State.CREATED
        self._trackers: dict[int, PartitionTracker] = {}
        self._committed: dict[int, int] = {}
        self._consumer: Any = None
        #: What the tracker waits for while Kafka is away (said once; waiting_for() for status and health).
        self._kafka = Outage(log, f"Tracker {self.name}", clock, stall_after=clients.STALL_AFTER)
        #: The redeliveries' transactions; batches fit the topics' max.message.bytes (None: no limit known).
        self._batch_limit: int | None = None
        txn_id = clients.transactional_id(config.tracker_group, self.name)
        self._redeliveries = TransactionalWriter(
            lambda: self._producer_factory(clients.redelivery_producer_config(config, self.name, txn_id,
                                                                              self._batch_limit)),
            self._kafka, caller=caller, transactional_id=txn_id)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._failure: BaseException | None = None
        self._redelivered: Counter[str] = Counter()
        self._dead: Counter[str] = Counter()
        self._starts: Counter[str] = Counter()
        self._ends: Counter[str] = Counter()
        self._next_commit = 0.0
        self._next_snapshot = 0.0
        self._warned_bad_marker = False
        self.snapshot = TrackerSnapshot()

    def start(self) -> None:
        """Join the trackers' group and start tracking in the background."""
        self.open()
        self._thread = threading.Thread(target=self._run, name="queue-tracker", daemon=True)
        self._thread.start()
        log.info("Tracking redeliveries as %s (markers topic %s, group %s, transactional id %s)", self.name,
                 self.config.markers_topic, self.config.tracker_group, self._redeliveries.transactional_id)

    def open(self) -> None:
        """Create the clients and join the group, starting no thread (start() and the simulator)."""
        if self.state is not State.CREATED:
            raise QueueError(f"cannot start a tracker that is {self.state.value}")
        problems = self.config.validate()
        if problems:
            raise QueueError("invalid queue configuration: " + "; ".join(map(str, problems)))
        try:
            self._batch_limit = self._create_topics(self.config, KAFKA_START_TIMEOUT)
            self._redeliveries.open(lambda producer, timeout: clients.init_transactions(producer, self.config,
                                                                                         timeout))
            self._consumer = self._consumer_factory(self._kafka.watch(clients.markers_consumer_config(self.config,
                                                                                                     self.name)))
            self._consumer.subscribe([self.config.markers_topic], on_assign=self._on_assign,
                                     on_revoke=self._on_revoke, on_lost=self._on_lost)
        except (KafkaUnavailable, clients.TransactionsUnavailable) as error:
            raise QueueError(str(error)) from None
        except KafkaException as error:
            bootstrap = self.config.base_kafka_config.get("bootstrap.servers", "?")
            raise QueueError(f"Kafka is unreachable at {bootstrap}: {kafka_reason(error)}") from None
        self.state = State.RUNNING

    def stop(self) -> None:
        """Ask the tracker to stop; returns at once."""
        self._stopping.set()
        if self.state is State.CREATED:
            self.state = State.STOPPED
            self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stopped (True) or `timeout` passes (False); re-raises a background failure."""
        if not self._stopped.wait(timeout):
            return False
        if self._failure is not None:
            raise QueueError(f"tracker failed: {kafka_reason(self._failure)}") from self._failure
        return True

    # -- tracker thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self.step()
            self._commit(force=True)
        except BaseException as error:
            self._failure = error
            log.error("Tracker stopping after a failure: %s", kafka_reason(error), exc_info=error)
        finally:
            self.close()

    def close(self) -> None:
        """Leave the group (committing what the revoke callback commits) and let go of the clients."""
        closed = False
        try:
            self._call(lambda timeout: self._consumer.close(), CLOSE_TIMEOUT)
            closed = True
        except (KafkaException, RuntimeError) as error:
            log.warning("Closing the markers consumer: %s", kafka_reason(error))
        self._redeliveries.producer = None
        if closed:  # else the abandoned close may still be running the revoke callback on the partitions
            self.snapshot = self._take_snapshot()
        self.state = State.STOPPED
        log.info("Tracker stopped (redelivered %d, dead-lettered %d)", sum(self._redelivered.values()),
                 sum(self._dead.values()))
        self._stopped.set()

    def step(self) -> None:
        """One round: read markers, redeliver or dead-letter what is due, commit now and then."""
        # poll() wakes at the first record (or the interval, to check deadlines); consume(timeout=0)
        # adds whatever else is already fetched.
        self._kafka.stalled()
        first = self._consumer.poll(self.config.poll_interval)
        records = [] if first is None else [first, *self._consumer.consume(self.fetch_batch - 1, timeout=0)]
        now = self._clock()
        for record in records:
            error = record.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:  # read to its end, past any control record
                    tracker = self._trackers.get(record.partition())
                    if tracker is not None:
                        tracker.reached_end(record.offset())
                    continue
                elif error.fatal():
                    raise KafkaException(error)
                else:
                    log.warning("Markers consumer: %s", error.str())
                continue
            self._apply(record, now)
        self._read_to()
        due = [entry for tracker in self._trackers.values() for entry in tracker.due(now)]
        if due:
            self._settle(due, now)
        else:
            # Asked of a partition whether it is tracked or not: a tracker whose group lost its partitions in the
            # outage has nothing else that would tell it the brokers are back (its rejoin may take a while longer).
            probed = TopicPartition(self.config.markers_topic, next(iter(self._trackers), 0))
            self._kafka.probe(lambda timeout: self._consumer.get_watermark_offsets(probed, timeout=timeout))
        self._commit()
        if now >= self._next_snapshot:
            self._next_snapshot = now + SNAPSHOT_INTERVAL
            self.snapshot = self._take_snapshot()

    def _read_to(self) -> None:
        """How far each partition is read: the consumer's position against the high watermark
        (tracker_state.py: caught up, or behind, or stopped by an open transaction)."""
        if not self._trackers:
            return
        topic = self.config.markers_topic
        try:
            positions = self._consumer.position([TopicPartition(topic, p) for p in self._trackers])
        except KafkaException as error:
            log.debug("Positions in the markers topic: %s", kafka_reason(error))
            positions = [TopicPartition(topic, p, -1) for p in self._trackers]
        for tp in positions:
            tracker = self._trackers.get(tp.partition)
            if tracker is not None:
                tracker.read_to(tp.offset if tp.offset >= 0 else None, self._high_watermark(tp.partition))

    def _high_watermark(self, partition: int) -> int | None:
        """The partition's end as of the last fetch, with what an open transaction hides (cached, no request)."""
        try:
            found = self._consumer.get_watermark_offsets(TopicPartition(self.config.markers_topic, partition),
                                                         cached=True)
        except (KafkaException, RuntimeError) as error:
            log.debug("Watermarks of markers partition %d: %s", partition, kafka_reason(error))
            return None
        return None if found is None else found[1]

    def _apply(self, record: Any, now: float) -> None:
        tracker = self._trackers.get(record.partition())
        if tracker is None:
            return
        try:
            marker = markers.decode(record.value(), record.headers())
        except MarkerError as error:
            if not self._warned_bad_marker:
                log.warning("Skipping a record of the markers topic that is not a marker (partition %d, offset %d): "
                            "%s", record.partition(), record.offset(), error)
                self._warned_bad_marker = True
            tracker.advance(record.offset(), record.timestamp()[1] / 1000, now)
            return
        queue = (record.key() or b"").decode("utf-8", "replace")
        tracker.apply(queue, marker, record.offset(), record.timestamp()[1] / 1000, now)
        if marker.kind is Kind.START:
            self._starts[queue] += 1
        elif marker.kind is Kind.END:
            self._ends[queue] += 1

    def _settle(self, due: list[Due], now: float) -> None:
        """Dead-letter and redeliver `due`; whatever fails is tried again after RETRY_BACKOFF."""
        dead = [entry for entry in due if entry.dead]
        if dead:
            try:
                self._dead_letters([self._dead_letter(entry) for entry in dead])
            except Exception as error:
                log.warning("Could not store %d dead letter(s): %s; trying again in %gs", len(dead),
                            first_line(error), RETRY_BACKOFF)
                self._postpone(dead, now)
                due = [entry for entry in due if not entry.dead]
                if not due:
                    return
        if not self._redeliveries.ready():  # a lost producer not replaced yet: Kafka cannot start transactions
            self._postpone(due, now)
            return
        offsets = self._offsets()

        def redeliveries(producer: Any) -> list[TopicPartition]:
            for entry in due:
                start = entry.start
                if not entry.dead:
                    headers = markers.message_headers(start.headers, message_id=start.message_id,
                                                      deliveries=entry.next_deliveries)
                    producer.produce(self.config.topic, key=start.key or entry.queue.encode(), value=start.payload,
                                     headers=headers)
                value, headers = markers.encode(Marker(Kind.END, start.ref))
                producer.produce(self.config.markers_topic, key=entry.queue.encode(), value=value, headers=headers,
                                 partition=entry.partition)
            return offsets

        error = self._redeliveries.run(redeliveries, self._consumer.consumer_group_metadata)
        if error is not None:
            log.debug("Redelivery of %d message(s) failed (%s); trying again in %gs", len(due), kafka_reason(error),
                      RETRY_BACKOFF)
            self._postpone(due, now)
            return
        for offset in offsets:
            self._committed[offset.partition] = offset.offset
        redelivered = Counter(entry.queue for entry in due if not entry.dead)
        dead_lettered = Counter(entry.queue for entry in due if entry.dead)
        for queue, count in redelivered.items():
            self._redelivered[queue] += count
            self._instruments.redelivered(queue, count)
            log.info("Redelivered %d message(s) of queue %s", count, queue)
        for queue, count in dead_lettered.items():
            self._dead[queue] += count
            self._instruments.dead_lettered(queue, count)
            log.warning("Moved %d message(s) of queue %s to the dead letters (max deliveries reached)", count, queue)

    def waiting_for(self) -> tuple[str, float] | None:
        """What the tracker has been waiting for while Kafka is away, and for how many seconds; None if nothing."""
        waited = self._kafka.waited()
        return (self._kafka.what, waited) if self._kafka.since is not None else None

    def _dead_letter(self, entry: Due) -> DeadLetter:
        start = entry.start
        headers = [(k, v) for k, v in start.headers if not k.startswith(markers.RESERVED_PREFIX)]
        tracker = self._trackers[entry.partition]
        return DeadLetter(entry.queue, start.message_id, start.key, start.payload, headers, start.deliveries,
                          tracker.in_progress[start.ref].started)

    def _postpone(self, due: list[Due], now: float) -> None:
        for entry in due:
            tracker = self._trackers.get(entry.partition)
            if tracker is not None:
                tracker.postpone(entry.start.ref, RETRY_BACKOFF, now)

    def _offsets(self) -> list[TopicPartition]:
        found = []
        for partition, tracker in self._trackers.items():
            offset = tracker.commit_offset()
            if offset is not None:
                found.append(TopicPartition(self.config.markers_topic, partition, offset))
        return found

    def _commit(self, force: bool = False, partitions: Sequence[int] | None = None) -> None:
        now = self._clock()
        if not force and now < self._next_commit:
            return
        self._next_commit = now + COMMIT_INTERVAL
        offsets = [tp for tp in self._offsets() if self._committed.get(tp.partition) != tp.offset
                   and (partitions is None or tp.partition in partitions)]
        if not offsets:
            return
        try:
            if not force:
                # Now and then: sent, not waited for (a lost coordinator must not hold the loop); the offsets
                # are sent again next time until a waited-for commit or a redelivery's transaction records them.
                self._consumer.commit(offsets=offsets, asynchronous=True)
                return
            self._call(lambda timeout: self._consumer.commit(offsets=offsets, asynchronous=False), COMMIT_TIMEOUT)
        except KafkaException as error:
            log.debug("Committing markers offsets: %s", kafka_reason(error))
            return
        for tp in offsets:
            self._committed[tp.partition] = tp.offset

    def _take_snapshot(self) -> TrackerSnapshot:
        queues: dict[str, QueueStats] = {}
        for tracker in self._trackers.values():
            for queue, stats in tracker.stats().items():
                total = queues.setdefault(queue, QueueStats())
                total.in_progress += stats.in_progress
                if stats.oldest_started is not None and (total.oldest_started is None
                                                         or stats.oldest_started < total.oldest_started):
                    total.oldest_started = stats.oldest_started
        return TrackerSnapshot(partitions=sorted(self._trackers), queues=queues, redelivered=dict(self._redelivered),
                               dead_lettered=dict(self._dead),
                               replaying=sorted(p for p, t in self._trackers.items() if not t.rebuilt),
                               starts=dict(self._starts), ends=dict(self._ends))

    # -- rebalances (called inside consume(), on the tracker thread) ------------------------------

    def _on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            self._trackers[tp.partition] = PartitionTracker(tp.partition)
        log.info("Tracking markers partition(s) %s", sorted(tp.partition for tp in partitions))

    def _on_revoke(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        revoked = {tp.partition for tp in partitions}
        self._commit(force=True, partitions=revoked)
        self._drop(revoked)

    def _on_lost(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        self._drop({tp.partition for tp in partitions})

    def _drop(self, partitions: set[int]) -> None:
        for partition in partitions:
            self._trackers.pop(partition, None)
            self._committed.pop(partition, None)
        if partitions:
            log.info("No longer tracking markers partition(s) %s", sorted(partitions))
