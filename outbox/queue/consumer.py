"""A consumer of one logical queue: receive messages, acknowledge each one in any order.

    with QueueConsumer(config, "emails") as consumer:      # start() on enter, close() on exit
        message = consumer.receive(timeout=1.0)             # None when nothing came
        if message is not None:
            send_email(message.payload)
            message.ack()

Threads: the fetcher reads the queue topic (one consumer group per logical queue, records of
other queues skipped by key) and, for each batch, writes the Start markers and commits the
consumer's offsets in one Kafka transaction, so a crash can neither lose a message (offset
committed, no Start marker) nor duplicate one (Start marker written, offset not committed:
kafka-mq-go's scenario 3). The keep-alive thread sends a KeepAlive marker for every message in
progress each keep_alive_interval, so a slow handler is never redelivered while its process lives.
ack() sends the End marker; retry() a KeepAlive with a short deadline; close() hands messages
never received back with Release markers, so they are redelivered at once.

Back-pressure: at most max_in_progress messages are held (buffered or received, not acked);
the fetcher pauses its partitions meanwhile, which keeps it in its consumer group.
"""

from __future__ import annotations

import json
import logging
import queue as stdlib_queue
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from outbox.harvest.config import default_name
from outbox.harvest.kafka import KafkaUnavailable, kafka_reason
from outbox.queue import clients, markers
from outbox.queue.config import QueueConfig, QueueLimits, check_queue_name
from outbox.queue.errors import QueueError
from outbox.queue.instruments import QueueInstruments
from outbox.queue.markers import Kind, Marker, Ref
from outbox.queue.topics import ensure_topics

log = logging.getLogger(__name__)

#: How long start() waits for Kafka to answer before reporting it unreachable.
KAFKA_START_TIMEOUT = 10.0
#: Records read from the queue topic at most per poll while paused (then handed back).
FETCH_BATCH = 500
#: Held full this long (slow handlers), the consumer pauses its partitions and polls to stay in its group.
FULL_PAUSE_AFTER = 5.0
#: Pause after a failed Start transaction before reading again.
ERROR_BACKOFF = 0.5
#: Offsets of records of other queues are committed at least this often (seconds) ...
FOREIGN_COMMIT_INTERVAL = 1.0
#: ... or after this many such records.
FOREIGN_COMMIT_RECORDS = 1000


class Message:
    """One delivery of a queue message. Acknowledge it with ack(); until then it is kept alive."""

    __slots__ = ("_consumer", "_last_marker", "_marker_partition", "_raw_headers", "_received_at", "_state",
                 "deliveries", "headers", "id", "key", "payload", "queue", "ref", "span")

    def __init__(self, consumer: QueueConsumer, record: Any, now: float) -> None:
        raw_headers = record.headers() or []
        self._consumer = consumer
        self.queue = consumer.queue
        self.ref: Ref = (record.partition(), record.offset())
        self.key: bytes = record.key()
        #: The body, as sent (str and JSON payloads arrive as UTF-8 bytes).
        self.payload: bytes = record.value() or b""
        #: The sender's headers (and the harvester's, for stashed messages); the queue's own are attributes.
        self.headers: list[tuple[str, str]] = [(k, (v or b"").decode("utf-8", "replace")) for k, v in raw_headers
                                               if not k.startswith(markers.RESERVED_PREFIX)]
        #: The same on every delivery of the message: the inbox's key.
        self.id: str = markers.header_text(raw_headers, markers.ID_HEADER) or markers.ref_id(self.ref)
        #: 1 on the first delivery; redeliveries count up (max_deliveries ends the round).
        self.deliveries: int = markers.deliveries_of(raw_headers)
        self._raw_headers = raw_headers
        self._marker_partition: int | None = None
        self._last_marker = now
        self._received_at = now
        self._state = "buffered"
        #: With tracing on, this delivery's OpenTelemetry span (ended when the message is settled); else None.
        self.span: Any = None

    @property
    def text(self) -> str:
        return self.payload.decode()

    def json(self) -> Any:
        return json.loads(self.payload)

    def ack(self) -> None:
        """Done: the tracker stops tracking the message (an End marker). A second ack does nothing."""
        self._consumer._finish(self, Kind.END)

    def retry(self, delay: float = 0.0) -> None:
        """Not done: redeliver after `delay` seconds (a delivery that counts towards max_deliveries)."""
        self._consumer._finish(self, Kind.KEEPALIVE, delay)

    def abandon(self) -> None:
        """Not done, and no hurry: stop keeping it alive; redelivered once its deadline passes."""
        self._consumer._finish(self, None)

    def __repr__(self) -> str:
        return f"<Message {self.queue}/{self.id} delivery {self.deliveries} at {self.ref[0]}:{self.ref[1]}>"


class QueueConsumer:
    """Receives the messages of one logical queue; thread-safe receive(), ack() from any thread."""

    def __init__(self, config: QueueConfig, queue: str, *, limits: QueueLimits | None = None, name: str | None = None,
                 instruments: QueueInstruments | None = None,
                 consumer_factory: Callable[[dict[str, Any]], Any] = Consumer,
                 producer_factory: Callable[[dict[str, Any]], Any] = Producer,
                 clock: Callable[[], float] = time.monotonic, tracer: Any = None) -> None:
        """`tracer`: an outbox.tracing.consume.QueueTracer, to give each delivery a span (docs/tracing.md)."""
        try:
            self.queue = check_queue_name(queue)
        except ValueError as error:
            raise QueueError(str(error)) from None
        self.config = config
        self.limits = limits or config.limits_for(queue)
        self.name = name or default_name()
        self._instruments = instruments or QueueInstruments()
        self._tracer = tracer
        self._consumer_factory, self._producer_factory, self._clock = consumer_factory, producer_factory, clock
        self._key = queue.encode()
        self._key_prefix = self._key + b"/"
        self._lock = threading.Lock()
        self._in_progress: dict[Ref, Message] = {}
        self._buffer: stdlib_queue.SimpleQueue[Message] = stdlib_queue.SimpleQueue()
        self._stopping = threading.Event()
        self._closed = False
        self._failure: BaseException | None = None
        self._consumer: Any = None
        self._starts: Any = None
        self._markers: Any = None
        self._fetcher: threading.Thread | None = None
        self._keeper: threading.Thread | None = None
        self._paused = False
        self._full_since: float | None = None
        self._room = threading.Event()
        self._pending: dict[int, int] = {}
        self._pending_records = 0
        self._last_foreign_commit = clock()
        #: Totals since start, for status rows and tests.
        self.received = self.acked = self.retried = self.abandoned = self.released = self.started = 0

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> QueueConsumer:
        """Connect, join the queue's consumer group and start fetching; QueueError with a one-line reason."""
        problems = self.config.validate() + self.limits.problems()
        if problems:
            raise QueueError("invalid queue configuration: " + "; ".join(map(str, problems)))
        try:
            ensure_topics(self.config, KAFKA_START_TIMEOUT)
            self._markers = self._producer_factory(clients.marker_producer_config(self.config, self.name))
            self._starts = self._producer_factory(clients.start_producer_config(self.config, self.queue, self.name))
            clients.init_transactions(self._starts, self.config, KAFKA_START_TIMEOUT)
            self._consumer = self._consumer_factory(clients.queue_consumer_config(self.config, self.queue, self.name))
            self._consumer.subscribe([self.config.topic], on_assign=self._on_assign)
        except (KafkaUnavailable, clients.TransactionsUnavailable) as error:
            self._close_clients()
            raise QueueError(str(error)) from None
        except KafkaException as error:
            self._close_clients()
            bootstrap = self.config.base_kafka_config.get("bootstrap.servers", "?")
            raise QueueError(f"Kafka is unreachable at {bootstrap}: {kafka_reason(error)}") from None
        self._fetcher = threading.Thread(target=self._fetch_loop, name=f"queue-fetch-{self.queue}", daemon=True)
        self._keeper = threading.Thread(target=self._keep_alive_loop, name=f"queue-keepalive-{self.queue}",
                                        daemon=True)
        self._fetcher.start()
        self._keeper.start()
        log.info("Consuming queue %s as %s (group %s, max %d in progress, redelivery after %gs)", self.queue,
                 self.name, self.config.consumer_group(self.queue), self.limits.max_in_progress,
                 self.limits.redelivery_timeout)
        return self

    def __enter__(self) -> QueueConsumer:
        return self if self._fetcher is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def receive(self, timeout: float | None = None) -> Message | None:
        """The next message, waiting up to `timeout` seconds (None: forever); None if none came."""
        if self._closed:
            raise QueueError(f"consumer of queue {self.queue!r} is closed")
        deadline = None if timeout is None else self._clock() + timeout
        while True:
            self._raise_failure()
            wait = 0.5 if deadline is None else min(0.5, deadline - self._clock())
            if wait <= 0:
                return None
            try:
                message = self._buffer.get(timeout=wait)
            except stdlib_queue.Empty:
                if self._stopping.is_set():
                    return None
                continue
            with self._lock:
                if message._state != "buffered":  # released by close() meanwhile
                    continue
                message._state = "received"
                message._received_at = self._clock()
                self.received += 1
            self._instruments.received(self.queue)
            return message

    def close(self, timeout: float = 30.0) -> None:
        """Stop fetching, release messages never received, wait up to `timeout` for the rest to be acked."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        if self._fetcher is not None:
            self._fetcher.join()
        with self._lock:
            buffered = [m for m in self._in_progress.values() if m._state == "buffered"]
            for message in buffered:
                self._send_marker(message, Kind.RELEASE)
                message._state = "done"
                if message.span is not None:
                    self._tracer.finished(message.span, "released")
                del self._in_progress[message.ref]
                self.released += 1
        deadline = self._clock() + timeout
        while self._in_progress and self._clock() < deadline:
            time.sleep(0.02)
        with self._lock:
            left = list(self._in_progress.values())
            for message in left:
                message._state = "done"
            self._in_progress.clear()
        if left:
            log.warning("Closing with %d message(s) of queue %s unacknowledged: they are redelivered after the "
                        "redelivery timeout", len(left), self.queue)
        if self._keeper is not None:
            self._keeper.join()
        self._close_clients()
        log.info("Closed consumer of queue %s (received %d, acked %d, retried %d, released %d)", self.queue,
                 self.received, self.acked, self.retried, self.released)

    @property
    def in_progress(self) -> int:
        """Messages held: buffered or received, and not yet acknowledged."""
        return len(self._in_progress)

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def oldest_in_progress(self) -> float | None:
        """Local monotonic time the oldest held message was received (or fetched), None if none."""
        with self._lock:
            return min((m._received_at for m in self._in_progress.values()), default=None)

    # -- acknowledgements (any thread) ------------------------------------------------------------

    def _finish(self, message: Message, kind: Kind | None, delay: float = 0.0) -> None:
        with self._lock:
            if message._state != "received":
                if message._state == "buffered":
                    raise QueueError("a message must be received before it is acknowledged")
                return  # acked, retried or abandoned already; or released by close()
            message._state = "done"
            del self._in_progress[message.ref]
            self._room.set()
            # Under the lock, so a keep-alive for this message can never follow its End or retry marker.
            if kind is not None:
                self._send_marker(message, kind, delay)
            if kind is Kind.END:
                self.acked += 1
            elif kind is Kind.KEEPALIVE:
                self.retried += 1
            else:
                self.abandoned += 1
        if message.span is not None:
            outcome = "acked" if kind is Kind.END else "retried" if kind is Kind.KEEPALIVE else "abandoned"
            self._tracer.finished(message.span, outcome, delay if kind is Kind.KEEPALIVE else None)
        if kind is Kind.END:
            self._instruments.acked(self.queue, self._clock() - message._received_at)
        elif kind is Kind.KEEPALIVE:
            self._instruments.retried(self.queue)
        else:
            self._instruments.abandoned(self.queue)

    def _send_marker(self, message: Message, kind: Kind, delay: float | None = None) -> None:
        after = self.limits.redelivery_timeout if delay is None else delay
        value, headers = markers.encode(Marker(kind, message.ref, after))
        kwargs: dict[str, Any] = {} if message._marker_partition is None else {"partition": message._marker_partition}
        try:
            self._markers.produce(self.config.markers_topic, key=self._key, value=value, headers=headers,
                                  on_delivery=self._marker_delivered, **kwargs)
        except BufferError:
            self._markers.poll(0.1)
            self._markers.produce(self.config.markers_topic, key=self._key, value=value, headers=headers,
                                  on_delivery=self._marker_delivered, **kwargs)
        except KafkaException as error:
            log.warning("Could not send a %s marker for %r: %s", kind.value, message, kafka_reason(error))

    def _marker_delivered(self, error: KafkaError | None, record: Any) -> None:
        if error is not None:
            log.warning("A marker of queue %s was not delivered (%s): its message may be redelivered", self.queue,
                        error.str())

    # -- keep-alive thread ------------------------------------------------------------------------

    def _keep_alive_loop(self) -> None:
        interval = self.limits.keep_alive_interval
        tick = min(interval / 4, 0.5)
        try:
            while not (self._stopping.is_set() and not self._in_progress):
                now = self._clock()
                with self._lock:
                    for message in self._in_progress.values():
                        if now - message._last_marker >= interval:
                            self._send_marker(message, Kind.KEEPALIVE)
                            message._last_marker = now
                self._markers.poll(tick)
        except BaseException as error:
            self._fail(error)

    # -- fetcher thread ---------------------------------------------------------------------------

    def _fetch_loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._fetch()
        except BaseException as error:
            self._fail(error)
        finally:
            # Leave the group at once: the queue's other consumers take the partitions over while
            # this one finishes what it holds (its acks go to the markers topic, not through the group).
            self._commit_foreign(force=True)
            try:
                self._consumer.close()
            except (KafkaException, RuntimeError) as error:
                log.warning("Closing the queue consumer: %s", kafka_reason(error))

    def _fetch(self) -> None:
        consumer = self._consumer
        free = self.limits.max_in_progress - len(self._in_progress)
        if free <= 0:
            self._wait_for_room()
            return
        self._full_since = None
        if self._paused:
            consumer.resume(consumer.assignment())
            self._paused = False
        # poll() returns as soon as one record is there; consume(timeout=0) adds what is already
        # fetched. (consume() with a timeout would wait for the whole batch: latency when quiet.)
        first = consumer.poll(self.config.poll_interval)
        if first is None:
            self._commit_foreign()
            return
        # At most `free` records, so never more of this queue than there is room for: the rest
        # stays in librdkafka's fetch queue (a seek back would discard it and cost a fetch).
        records = [first, *consumer.consume(free - 1, timeout=0)] if free > 1 else [first]
        ours: list[Any] = []
        positions: dict[int, int] = {}
        first_offsets: dict[int, int] = {}
        for record in records:
            error = record.error()
            if error is not None:
                if error.fatal():
                    raise KafkaException(error)
                log.warning("Queue consumer: %s", error.str())
                continue
            partition = record.partition()
            first_offsets.setdefault(partition, record.offset())
            key = record.key()
            if key == self._key or (key is not None and key.startswith(self._key_prefix)):
                ours.append(record)
            positions[partition] = record.offset() + 1
        if ours:
            self._start(ours, positions, first_offsets)
        elif positions:
            self._pending.update(positions)
            self._pending_records += len(records)
            self._commit_foreign()

    def _wait_for_room(self) -> None:
        """Back-pressure: wait for an ack; held full for long, pause the partitions and keep polling."""
        now = self._clock()
        if self._full_since is None:
            self._full_since = now
        if not self._paused and now - self._full_since < FULL_PAUSE_AFTER:
            self._room.wait(self.config.poll_interval)
            self._room.clear()
            return
        consumer = self._consumer
        if not self._paused:
            consumer.pause(consumer.assignment())
            self._paused = True
        # Polls keep the consumer in its group (max.poll.interval.ms) and serve rebalances while paused.
        self._rewind(consumer.consume(FETCH_BATCH, timeout=self.config.poll_interval))

    def _start(self, records: list[Any], positions: dict[int, int], first: dict[int, int]) -> None:
        """Start markers for `records` and the consumer's offsets, in one transaction; then hand them out."""
        now = self._clock()
        batch = [Message(self, record, now) for record in records]
        if self._tracer is not None:
            for message in batch:
                message.span = self._tracer.started(message, self._earlier_deliveries(message))
        partitions: dict[Ref, int] = {}

        def delivered(ref: Ref) -> Callable[[KafkaError | None, Any], None]:
            def report(error: KafkaError | None, record: Any) -> None:
                if error is None:
                    partitions[ref] = record.partition()
            return report

        offsets = {**self._pending, **positions}
        producer = self._starts
        try:
            producer.begin_transaction()
            for message in batch:
                value, headers = markers.encode(self._start_marker(message))
                producer.produce(self.config.markers_topic, key=self._key, value=value, headers=headers,
                                 on_delivery=delivered(message.ref))
            producer.send_offsets_to_transaction(
                [TopicPartition(self.config.topic, p, o) for p, o in offsets.items()],
                self._consumer.consumer_group_metadata(), KAFKA_START_TIMEOUT)
            self._commit_transaction()
        except KafkaException as error:
            self._abort(error)
            for partition, offset in first.items():  # read the batch again: nothing of it was started
                self._seek(partition, offset)
            self._stopping.wait(ERROR_BACKOFF)
            return
        producer.poll(0)  # delivery reports: the markers partition of each message
        self._pending.clear()
        self._pending_records = 0
        self.started += len(batch)
        with self._lock:
            for message in batch:
                # Later markers of the message go to the partition its Start went to, even if the
                # markers topic gains partitions meanwhile.
                message._marker_partition = partitions.get(message.ref)
                message._last_marker = now
                self._in_progress[message.ref] = message
        for message in batch:
            self._buffer.put(message)

    def _start_marker(self, message: Message) -> Marker:
        headers = markers.message_headers(message._raw_headers, message_id=message.id, deliveries=message.deliveries)
        if message.span is not None:
            own = self._tracer.traceparent(message.span)
            if own:
                links = [*self._earlier_deliveries(message), own]
                headers = [(k, v) for k, v in headers if k != markers.TRACE_LINKS_HEADER]
                headers.append((markers.TRACE_LINKS_HEADER, ",".join(links[-16:]).encode()))
        return Marker(Kind.START, message.ref, self.limits.redelivery_timeout, key=message.key,
                      payload=message.payload, headers=tuple(headers), max_deliveries=self.limits.max_deliveries)

    @staticmethod
    def _earlier_deliveries(message: Message) -> list[str]:
        text = markers.header_text(message._raw_headers, markers.TRACE_LINKS_HEADER)
        return [part for part in text.split(",") if part] if text else []

    def _commit_transaction(self) -> None:
        for attempt in range(3):
            try:
                self._starts.commit_transaction(KAFKA_START_TIMEOUT)
                return
            except KafkaException as error:
                kerror = clients.kafka_error(error)
                if kerror is None or not kerror.retriable() or attempt == 2:
                    raise

    def _abort(self, error: KafkaException) -> None:
        kerror = clients.kafka_error(error)
        if kerror is not None and kerror.fatal():
            raise error
        log.warning("Start markers for queue %s not written (%s); reading the batch again", self.queue,
                    kafka_reason(error))
        try:
            self._starts.abort_transaction(KAFKA_START_TIMEOUT)
        except KafkaException as abort_error:
            aerror = clients.kafka_error(abort_error)
            if aerror is not None and aerror.fatal():
                raise abort_error from error
            log.warning("Aborting the transaction: %s", kafka_reason(abort_error))

    def _rewind(self, records: list[Any]) -> None:
        """Records fetched while paused: read them again once there is room."""
        first: dict[int, int] = {}
        for record in records:
            if record.error() is None:
                first.setdefault(record.partition(), record.offset())
        for partition, offset in first.items():
            self._seek(partition, offset)

    def _seek(self, partition: int, offset: int) -> None:
        try:
            self._consumer.seek(TopicPartition(self.config.topic, partition, offset))
        except KafkaException as error:  # no longer assigned: its new owner starts from the committed offset
            log.debug("Seek on partition %d: %s", partition, kafka_reason(error))

    def _commit_foreign(self, force: bool = False) -> None:
        """Commit past records of other queues now and then, so a restart does not read them all again."""
        if not self._pending:
            return
        now = self._clock()
        if not force and self._pending_records < FOREIGN_COMMIT_RECORDS \
                and now - self._last_foreign_commit < FOREIGN_COMMIT_INTERVAL:
            return
        try:
            self._consumer.commit(offsets=[TopicPartition(self.config.topic, p, o) for p, o in self._pending.items()],
                                  asynchronous=False)
        except KafkaException as error:
            log.debug("Committing past other queues' records: %s", kafka_reason(error))
        self._pending.clear()
        self._pending_records = 0
        self._last_foreign_commit = now

    def _on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        consumer.incremental_assign(partitions)
        if self._paused:
            consumer.pause(partitions)

    # -- failures ---------------------------------------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        if self._failure is None:
            self._failure = error
            log.error("Consumer of queue %s failed: %s", self.queue, kafka_reason(error), exc_info=error)
        self._stopping.set()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise QueueError(f"consumer of queue {self.queue!r} failed: {kafka_reason(self._failure)}") \
                from self._failure

    def _close_clients(self) -> None:
        if self._markers is not None:
            remaining = self._markers.flush(10)
            if remaining:
                log.warning("%d marker(s) of queue %s not delivered at close", remaining, self.queue)
        self._markers = self._starts = None
