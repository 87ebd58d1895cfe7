"""A consumer of one logical queue: receive messages, acknowledge each one in any order.

    with QueueConsumer(config, "emails") as consumer:      # start() on enter, close() on exit
        message = consumer.receive(timeout=1.0)             # None when nothing came
        if message is not None:
            send_email(message.payload)
            message.ack()

What to do is decided by ConsumerState (consumer_state.py, no I/O); this module carries it out
over Kafka. Threads: the fetcher reads the queue topic (one consumer group per logical queue,
records of other queues skipped by key) and, for each batch, writes the Start markers and commits
the consumer's offsets in one Kafka transaction, so a crash can neither lose a message (offset
committed, no Start marker) nor duplicate one (Start marker written, offset not committed:
kafka-mq-go's scenario 3). The keep-alive thread sends a KeepAlive marker for every message in
progress each keep_alive_interval, so a slow handler is never redelivered while its process lives.
ack() sends the End marker; retry() a KeepAlive with a short deadline; close() hands messages
never received back with Release markers, so they are redelivered at once.

The threads run `fetch()` and `keep_alive()`, each one round that never waits except inside a
Kafka client's poll; the simulator (tests/sim/) calls the same methods on its own clock, after
`open()`, and closes in the same steps `close()` takes.

A broker restart ends no consumer: a Start transaction that fails is aborted and its batch read
again; a transactional producer that fails for good is replaced by one with the same transactional
id (transactional.py), after which the consumer reads on from its group's committed offsets. While
it waits it says so once, and `waiting_for()` tells its status row, metrics and health probe.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from outbox.kafka.clients import KAFKA_START_TIMEOUT, KafkaUnavailable
from outbox.kafka.names import default_name
from outbox.kafka.outage import Outage
from outbox.queue import clients, markers
from outbox.queue.config import QueueConfig, QueueLimits, check_queue_name
from outbox.queue.consumer_state import ConsumerState, Delivery, Held, Plan, StartBatch
from outbox.queue.delivery_spans import DeliverySpans, NoSpans
from outbox.queue.errors import QueueError
from outbox.queue.instruments import QueueInstruments
from outbox.queue.marker_sender import MarkerSender
from outbox.queue.markers import Kind, Ref
from outbox.queue.receiving import wait_for_delivery
from outbox.queue.topics import ensure_topics
from outbox.queue.transactional import Caller, TransactionalWriter, call_with_deadline
from outbox.reasons import kafka_reason

log = logging.getLogger(__name__)

#: Records read from the queue topic at most per poll while paused (then handed back).
FETCH_BATCH = 500
#: Pause after a failed Start transaction before reading again.
ERROR_BACKOFF = 0.5


@dataclass(frozen=True, slots=True)
class Wait:
    """What the fetcher waits for before its next round."""

    seconds: float = 0.0
    #: A settled message (room to read more) ends the wait early.
    for_room: bool = False


def _without_errors(records: list[Any]) -> list[Any]:
    """The records without the errors among them (a fatal one raises)."""
    good = []
    for record in records:
        error = record.error()
        if error is None:
            good.append(record)
        elif error.fatal():
            raise KafkaException(error)
        else:
            log.warning("Queue consumer: %s", error.str())
    return good


class Message:
    """One delivery of a queue message. Acknowledge it with ack(); until then it is kept alive."""

    __slots__ = ("_consumer", "_delivery", "deliveries", "headers", "id", "key", "payload", "queue", "ref", "span")

    def __init__(self, consumer: QueueConsumer, delivery: Delivery) -> None:
        self._consumer = consumer
        self._delivery = delivery
        self.queue = consumer.queue
        self.ref: Ref = delivery.ref
        self.key: bytes | None = delivery.key
        #: The body, as sent (str and JSON payloads arrive as UTF-8 bytes).
        self.payload: bytes = delivery.payload
        #: The sender's headers (and the harvester's, for stashed messages); the queue's own are attributes.
        self.headers: list[tuple[str, str]] = [(k, (v or b"").decode("utf-8", "replace"))
                                               for k, v in delivery.raw_headers
                                               if not k.startswith(markers.RESERVED_PREFIX)]
        #: The same on every delivery of the message: the inbox's key.
        self.id: str = delivery.id
        #: 1 on the first delivery; redeliveries count up (max_deliveries ends the round).
        self.deliveries: int = delivery.deliveries
        #: With tracing on, this delivery's OpenTelemetry span (ended when the message is settled); else None.
        self.span: Any = consumer.spans.get(delivery.ref)

    @property
    def text(self) -> str:
        return self.payload.decode()

    def json(self) -> Any:
        return json.loads(self.payload)

    def ack(self) -> None:
        """Done: the tracker stops tracking the message (an End marker). A second ack does nothing."""
        self._consumer._settle(self, Kind.END)

    def retry(self, delay: float = 0.0) -> None:
        """Not done: redeliver after `delay` seconds (a delivery that counts towards max_deliveries)."""
        self._consumer._settle(self, Kind.KEEPALIVE, delay)

    def abandon(self) -> None:
        """Not done, and no hurry: stop keeping it alive; redelivered once its deadline passes."""
        self._consumer._settle(self, None)

    def after_failure(self) -> tuple[str, bool]:
        """What a failed handler's abandon() does to this delivery, in words for the log, and whether the handler's
        traceback belongs in that line (else it is logged at DEBUG): it depends on the backend."""
        return self._consumer._after_failure(self)

    def __repr__(self) -> str:
        return f"<Message {self.queue}/{self.id} delivery {self.deliveries} at {self.ref[0]}:{self.ref[1]}>"


def after_failure(limits: QueueLimits, deliveries: int) -> str:
    """The tracker redelivers an abandoned message once its deadline passes, or, its last delivery
    (max_deliveries), moves it to the dead letters then (tracker_state.due)."""
    limit, timeout = limits.max_deliveries, limits.redelivery_timeout
    if limit is not None and deliveries >= limit:
        return f"a dead letter after the redelivery timeout ({timeout:g} s): delivery {deliveries} of {limit}"
    return f"redelivered after the redelivery timeout ({timeout:g} s)"


class QueueConsumer:
    """Receives the messages of one logical queue; thread-safe receive(), ack() from any thread."""

    def __init__(self, config: QueueConfig, queue: str, *, limits: QueueLimits | None = None, name: str | None = None,
                 instruments: QueueInstruments | None = None,
                 consumer_factory: Callable[[dict[str, Any]], Any] = Consumer,
                 producer_factory: Callable[[dict[str, Any]], Any] = Producer,
                 clock: Callable[[], float] = time.monotonic,
                 create_topics: Callable[[QueueConfig, float], int | None] = ensure_topics,
                 tracer: Any = None, caller: Caller = call_with_deadline) -> None:
        """`tracer`: an outbox.tracing.consume.QueueTracer, to give each delivery a span (docs/tracing.md);
        `caller`: how a call into librdkafka that may hang is made (transactional.py; the simulator's never do)."""
        try:
            self.queue = check_queue_name(queue)
        except ValueError as error:
            raise QueueError(str(error)) from None
        self.config = config
        self.limits = limits or config.limits_for(queue)
        self.name = name or default_name()
        self._instruments = instruments or QueueInstruments()
        self._consumer_factory, self._producer_factory, self._clock = consumer_factory, producer_factory, clock
        self._create_topics = create_topics
        #: Tracing on: each held delivery's span (delivery_spans.py).
        self.spans: DeliverySpans | NoSpans = DeliverySpans(tracer) if tracer is not None else NoSpans()
        self._key = queue.encode()
        self._state = ConsumerState(self.queue, self.limits, clock())
        # One lock over the state; markers are sent under it, so a keep-alive never follows its
        # message's End or retry marker.
        self._lock = threading.Lock()
        self._buffered = threading.Condition(self._lock)
        self._room = threading.Event()
        self._stopping = threading.Event()
        self._closed = False
        self._failure: BaseException | None = None
        self._consumer: Any = None
        self._markers: MarkerSender | None = None
        #: What the consumer waits for while Kafka is away (said once; waiting_for() for status and health).
        self._kafka = Outage(log, f"Consumer of queue {self.queue}", clock, stall_after=clients.STALL_AFTER)
        #: The Start markers' transactions; batches fit the topics' max.message.bytes (None: no limit known).
        self._batch_limit: int | None = None
        txn_id = clients.transactional_id(config.consumer_group(self.queue), self.name)
        self._starts = TransactionalWriter(
            lambda: self._producer_factory(clients.start_producer_config(config, self.name, txn_id,
                                                                         self._batch_limit)),
            self._kafka, caller=caller, transactional_id=txn_id)
        #: After a lost producer: read on from the group's committed offsets, once they can be read.
        self._reposition = False
        self._fetcher: threading.Thread | None = None
        self._keeper: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> QueueConsumer:
        """Connect, join the queue's consumer group and start fetching; QueueError with a one-line reason."""
        self.open()
        self._fetcher = threading.Thread(target=self._fetch_loop, name=f"queue-fetch-{self.queue}", daemon=True)
        self._keeper = threading.Thread(target=self._keep_alive_loop, name=f"queue-keepalive-{self.queue}",
                                        daemon=True)
        self._fetcher.start()
        self._keeper.start()
        log.info("Consuming queue %s as %s (group %s, transactional id %s, max %d in progress, redelivery after %gs)",
                 self.queue, self.name, self.config.consumer_group(self.queue), self._starts.transactional_id,
                 self.limits.max_in_progress, self.limits.redelivery_timeout)
        return self

    def open(self) -> None:
        """Create the clients and join the group, starting no thread (start() and the simulator)."""
        problems = self.config.validate() + self.limits.problems()
        if problems:
            raise QueueError("invalid queue configuration: " + "; ".join(map(str, problems)))
        try:
            self._batch_limit = self._create_topics(self.config, KAFKA_START_TIMEOUT)
            # Watched as the consumer is: the keep-alive thread polls it all the time, so its errors come when
            # they happen.
            self._markers = MarkerSender(self.queue, self.config.markers_topic, lambda: self._producer_factory(
                self._kafka.watch(clients.marker_producer_config(self.config, self.name, self._batch_limit))))
            self._starts.open(lambda producer, timeout: clients.init_transactions(producer, self.config, timeout))
            self._consumer = self._consumer_factory(self._kafka.watch(clients.queue_consumer_config(
                self.config, self.queue, self.name)))
            self._consumer.subscribe([self.config.topic], on_assign=self._on_assign, on_revoke=self._on_revoke,
                                     on_lost=self._on_revoke)
        except (KafkaUnavailable, clients.TransactionsUnavailable) as error:
            self.close_clients()
            raise QueueError(str(error)) from None
        except KafkaException as error:
            self.close_clients()
            bootstrap = self.config.base_kafka_config.get("bootstrap.servers", "?")
            raise QueueError(f"Kafka is unreachable at {bootstrap}: {kafka_reason(error)}") from None

    def __enter__(self) -> QueueConsumer:
        return self if self._fetcher is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def receive(self, timeout: float | None = None) -> Message | None:
        """The next message, waiting up to `timeout` seconds (None: forever); None if none came."""
        if self._closed:
            raise QueueError(f"consumer of queue {self.queue!r} is closed")
        delivery = wait_for_delivery(self._buffered, self._state, self._clock, self._stopping, self._raise_failure,
                                     timeout)
        if delivery is None:
            return None
        self._instruments.received(self.queue)
        return Message(self, delivery)

    def close(self, timeout: float = 30.0) -> None:
        """Stop fetching, release messages never received, wait up to `timeout` for the rest to be acked."""
        if self._closed:
            return
        self.stop_fetching()
        if self._fetcher is not None:
            self._fetcher.join()  # it leaves the group as it ends
        else:
            self.leave()
        self.release()
        deadline = self._clock() + timeout
        while self.in_progress and self._clock() < deadline:
            time.sleep(0.02)
        self.drop_held()
        if self._keeper is not None:
            self._keeper.join()
        self.close_clients()
        log.info("Closed consumer of queue %s (received %d, acked %d, retried %d, released %d)", self.queue,
                 self.received, self.acked, self.retried, self.released)

    # The steps of close(), each on its own for the simulator.

    def stop_fetching(self) -> None:
        """No more reading; receive() raises from now on."""
        self._closed = True
        self._stopping.set()
        with self._buffered:
            self._buffered.notify_all()

    def leave(self) -> None:
        """Commit past other queues' records and leave the group at once: the queue's other consumers
        take the partitions over while this one finishes what it holds (its acks go to the markers
        topic, not through the group)."""
        consumer, self._consumer = self._consumer, None
        if consumer is None:
            return
        self._commit_foreign(consumer, force=True)
        try:
            consumer.close()
        except (KafkaException, RuntimeError) as error:
            log.warning("Closing the queue consumer: %s", kafka_reason(error))

    def release(self) -> None:
        """Hand messages never received back (Release markers: redelivered at once, no delivery counted)."""
        with self._lock:
            for delivery, marker in self._state.release_buffered():
                self._markers.send(marker, delivery.marker_partition, delivery.id)
                self.spans.finish(delivery, "released")

    def drop_held(self) -> None:
        with self._lock:
            left = self._state.drop_held()
            for delivery in left:
                self.spans.finish(delivery, "unsettled")
        if left:
            log.warning("Closing with %d message(s) of queue %s unacknowledged: they are redelivered after the "
                        "redelivery timeout", len(left), self.queue)

    def close_clients(self) -> None:
        if self._markers is not None:
            self._markers.close(10)
        self._markers = None
        self._starts.producer = None

    # -- figures ----------------------------------------------------------------------------------

    @property
    def in_progress(self) -> int:
        """Messages held: buffered or received, and not yet acknowledged."""
        return len(self._state.held)

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def waiting_for(self) -> tuple[str, float] | None:
        """What the consumer has been waiting for while Kafka is away, and for how many seconds; None if nothing."""
        waited = self._kafka.waited()
        return (self._kafka.what, waited) if self._kafka.since is not None else None

    @property
    def producers_replaced(self) -> int:
        """Start-marker producers lost to a fatal error and replaced since the start."""
        return self._starts.replaced

    def oldest_in_progress(self) -> float | None:
        """Local monotonic time the oldest held message was received (or fetched), None if none."""
        with self._lock:
            return self._state.oldest_received()

    #: Totals since start, for status rows and tests.
    received = property(lambda self: self._state.received)
    acked = property(lambda self: self._state.acked)
    retried = property(lambda self: self._state.retried)
    abandoned = property(lambda self: self._state.abandoned)
    released = property(lambda self: self._state.released)
    started = property(lambda self: self._state.started)

    # -- settling (any thread) --------------------------------------------------------------------

    def _after_failure(self, message: Message) -> tuple[str, bool]:
        """What the tracker does with an abandoned delivery (after_failure); the traceback goes with the one line,
        as a failure is that rare."""
        return after_failure(self.limits, message.deliveries), True

    def _settle(self, message: Message, kind: Kind | None, delay: float = 0.0) -> None:
        delivery = message._delivery
        with self._lock:
            if delivery.state is Held.DONE:
                return  # acked, retried or abandoned already; or released by close()
            marker = self._state.settle(delivery, kind, delay)
            self._room.set()
            if marker is not None:
                self._markers.send(marker, delivery.marker_partition, delivery.id)
            if self.spans:
                self.spans.finish(delivery, "acked" if kind is Kind.END else "retried" if kind is Kind.KEEPALIVE
                                  else "abandoned", delay if kind is Kind.KEEPALIVE else None)
        if kind is Kind.END:
            self._instruments.acked(self.queue, self._clock() - delivery.received_at)
        elif kind is Kind.KEEPALIVE:
            self._instruments.retried(self.queue)
        else:
            self._instruments.abandoned(self.queue)

    # -- keep-alives ------------------------------------------------------------------------------

    def keep_alive(self) -> None:
        """One round: a KeepAlive marker for each held message that is due one."""
        with self._lock:
            for delivery, marker in self._state.keep_alives(self._clock()):
                self._markers.send(marker, delivery.marker_partition, delivery.id)

    def _keep_alive_loop(self) -> None:
        interval = self.limits.keep_alive_interval
        assert interval is not None
        tick = min(interval / 4, 0.5)
        try:
            while not (self._stopping.is_set() and not self._state.held):
                self.keep_alive()
                self._markers.poll(tick)
        except BaseException as error:
            self._fail(error)

    # -- fetching ---------------------------------------------------------------------------------

    def _fetch_loop(self) -> None:
        try:
            while not self._stopping.is_set():
                wait = self.fetch()
                if wait.for_room:
                    self._room.wait(wait.seconds)
                    self._room.clear()
                elif wait.seconds:
                    self._stopping.wait(wait.seconds)
        except BaseException as error:
            self._fail(error)
        finally:
            self.leave()

    def fetch(self) -> Wait:
        """One round of the fetcher: read, start what is this queue's, or wait for room (or for Kafka)."""
        consumer = self._consumer
        self._kafka.stalled()
        if (self._starts.lost or self._reposition) and not self._recover(consumer):
            return Wait(ERROR_BACKOFF)
        with self._lock:
            plan = self._state.fetch_plan(self._clock())
        if plan.plan is Plan.WAIT:
            return Wait(self.config.poll_interval, for_room=True)
        if plan.plan is not Plan.READ:
            if plan.plan is Plan.PAUSE:
                consumer.pause(consumer.assignment())
            # Polls keep the consumer in its group (max.poll.interval.ms) and serve rebalances while paused.
            self._seek_back(ConsumerState.rewind(_without_errors(consumer.consume(FETCH_BATCH,
                                                                             timeout=self.config.poll_interval))))
            return Wait()
        if plan.resume:
            consumer.resume(consumer.assignment())
        # poll() returns as soon as one record is there; consume(timeout=0) adds what is already
        # fetched. (consume() with a timeout would wait for the whole batch: latency when quiet.)
        first = consumer.poll(self.config.poll_interval)
        if first is None:
            self._commit_foreign(consumer)
            self._kafka.probe(lambda timeout: consumer.get_watermark_offsets(TopicPartition(self.config.topic, 0),
                                                                             timeout=timeout))
            return Wait()
        # At most `room` records, so never more of this queue than there is room for: the rest
        # stays in librdkafka's fetch queue (a seek back would discard it and cost a fetch).
        records = [first, *consumer.consume(plan.room - 1, timeout=0)] if plan.room > 1 else [first]
        with self._lock:
            batch = self._state.read(_without_errors(records), self._clock())
        if batch is not None:
            return self._start(batch)
        self._commit_foreign(consumer)
        return Wait()

    def _start(self, batch: StartBatch) -> Wait:
        """Start markers for the batch and the consumer's offsets, in one transaction; then hand it out."""
        partitions: dict[Ref, int] = {}

        def delivered(ref: Ref) -> Callable[[KafkaError | None, Any], None]:
            def report(error: KafkaError | None, record: Any) -> None:
                if error is None:
                    partitions[ref] = record.partition()
            return report

        def starts(producer: Any) -> list[TopicPartition]:
            for delivery in batch.deliveries:
                marker = self.spans.start(delivery, self._state.start_marker(delivery))
                value, headers = markers.encode(marker)
                producer.produce(self.config.markers_topic, key=self._key, value=value, headers=headers,
                                 on_delivery=delivered(delivery.ref))
            return [TopicPartition(self.config.topic, p, o) for p, o in batch.offsets.items()]

        error = self._starts.run(starts, self._consumer.consumer_group_metadata)
        if error is not None:
            self.spans.drop(batch.deliveries)  # not started: their spans are dropped unfinished
            log.debug("Start markers for queue %s not written (%s); reading the batch again", self.queue,
                      kafka_reason(error))
            self._seek_back(batch.rewind)  # read the batch again: nothing of it was started
            # A lost producer's last transaction may have committed after all: once a new producer has settled
            # it, the group's committed offsets say where to read on.
            self._reposition = self._starts.lost
            return Wait(ERROR_BACKOFF)
        self._starts.producer.poll(0)  # delivery reports: the markers partition of each message
        with self._buffered:
            self._state.batch_started(batch, partitions, self._clock())
            self._buffered.notify_all()
        return Wait()

    def _recover(self, consumer: Any) -> bool:
        """After a lost producer: a new one (its init_transactions() settles what the old one left open), then
        the group's committed offsets as the place to read on from. False while Kafka cannot give either."""
        if not self._starts.ready():
            return False
        if self._reposition:
            try:
                committed = consumer.committed(consumer.assignment(), timeout=KAFKA_START_TIMEOUT)
            except KafkaException as error:
                self._kafka.waiting("the group's committed offsets", error)
                return False
            for tp in committed:
                if tp.offset >= 0:
                    self._seek_back({tp.partition: tp.offset})
            self._reposition = False
        self._kafka.resumed()
        return True

    def _seek_back(self, offsets: dict[int, int]) -> None:
        for partition, offset in offsets.items():
            try:
                self._consumer.seek(TopicPartition(self.config.topic, partition, offset))
            except KafkaException as error:  # no longer assigned: its new owner starts from the committed offset
                log.debug("Seek on partition %d: %s", partition, kafka_reason(error))

    def _commit_foreign(self, consumer: Any, force: bool = False) -> None:
        """Commit past records of other queues now and then, so a restart does not read them all again."""
        with self._lock:
            offsets = self._state.foreign_offsets(self._clock(), force)
        if not offsets:
            return
        try:
            consumer.commit(offsets=[TopicPartition(self.config.topic, p, o) for p, o in offsets.items()],
                            asynchronous=False)
        except KafkaException as error:
            log.debug("Committing past other queues' records: %s", kafka_reason(error))

    def _on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        consumer.incremental_assign(partitions)
        if self._state.paused:
            consumer.pause(partitions)

    def _on_revoke(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        # (confluent-kafka unassigns them after the callback returns.)
        with self._lock:
            self._state.revoked(tp.partition for tp in partitions)

    # -- failures ---------------------------------------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        if self._failure is None:
            self._failure = error
            log.error("Consumer of queue %s failed: %s", self.queue, kafka_reason(error), exc_info=error)
        self._stopping.set()
        with self._buffered:
            self._buffered.notify_all()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise QueueError(f"consumer of queue {self.queue!r} failed: {kafka_reason(self._failure)}") \
                from self._failure
