"""A consumer of one share queue: Kafka's share groups (KIP-932) instead of our markers protocol.

    with ShareQueueConsumer(config, "emails", dead_letters=store.store_dead_letters) as consumer:
        message = consumer.receive(timeout=1.0)        # the same Message as the markers backend's
        ...
        message.ack()                                   # ACCEPT; retry() RELEASE; the last failure REJECT

What to do is decided by share_state.py (no I/O); this module carries it out. The client is not
thread-safe, so one thread (the poller) makes every call on it: it polls a batch, hands it to
receive(), and sends the acknowledgements the application's threads decided (ack() from any
thread only records a verdict). The client takes no poll until every record of the last one is
acknowledged, so a batch is at most max_in_progress records (`max.poll.records`).

Redelivery is Kafka's: a record whose lock (the queue's redelivery_timeout) expires, or whose
consumer died or left, is delivered again with its delivery count up by one. This client has no
lock renewal (RENEW), so a handler must finish within redelivery_timeout; keep_alive_interval is
not used by this backend.

With tracing on, each delivery handed out by receive() has a span (delivery_spans.py), as on the
markers backend.

A broker restart ends no consumer: acknowledgements Kafka refused meanwhile come back as
redeliveries, a poll that fails is tried again, and a client that failed for good is replaced (its
records come back when their locks end). While it waits it says so once (`waiting_for()`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import AcknowledgeType, IllegalStateException, KafkaError, KafkaException, ShareConsumer
from confluent_kafka.admin import AdminClient

from outbox.kafka.clients import KAFKA_START_TIMEOUT, KafkaUnavailable, admin_config
from outbox.kafka.names import default_name
from outbox.kafka.outage import Outage, fatal, permanent
from outbox.queue import clients, markers
from outbox.queue.config import QueueConfig, QueueLimits, check_queue_name
from outbox.queue.consumer_state import Delivery, Held
from outbox.queue.delivery_spans import DeliverySpans, NoSpans
from outbox.queue.errors import QueueError
from outbox.queue.instruments import QueueInstruments
from outbox.queue.markers import Kind
from outbox.queue.markers_consumer import Message
from outbox.queue.receiving import wait_for_delivery
from outbox.queue.share_group import configure_group, ensure_share_topic
from outbox.queue.share_state import Ack, Outcome, Settling, ShareState, verdict
from outbox.queue.tracker import DeadLetter
from outbox.reasons import kafka_error, kafka_reason

log = logging.getLogger(__name__)
#: Acknowledgements Kafka refused are said at most this often (seconds), with how many there were.
REFUSALS_SAID_EVERY = 10.0

DeadLetterSink = Callable[[Sequence[DeadLetter]], None]
_ACK_TYPES = {Ack.ACCEPT: AcknowledgeType.ACCEPT, Ack.RELEASE: AcknowledgeType.RELEASE,
              Ack.REJECT: AcknowledgeType.REJECT}
_OUTCOMES = {Kind.END: Outcome.ACKED, Kind.KEEPALIVE: Outcome.RETRIED, None: Outcome.ABANDONED}


def prepare_share_group(config: QueueConfig, queue: str, limits: QueueLimits, timeout: float) -> None:
    """The queue's share topic, and its share group configured before anyone joins (share_group.py)."""
    ensure_share_topic(config, queue, timeout)
    configure_group(config, queue, limits, timeout)


class ShareQueueConsumer:
    """Receives the messages of one share queue; thread-safe receive(), ack() from any thread."""

    def __init__(self, config: QueueConfig, queue: str, *, dead_letters: DeadLetterSink,
                 limits: QueueLimits | None = None, name: str | None = None,
                 instruments: QueueInstruments | None = None,
                 consumer_factory: Callable[[dict[str, Any]], Any] = ShareConsumer,
                 clock: Callable[[], float] = time.monotonic, tracer: Any = None,
                 prepare: Callable[[QueueConfig, str, QueueLimits, float], None] = prepare_share_group) -> None:
        """`tracer`: an outbox.tracing.consume.QueueTracer, to give each delivery a span (docs/tracing.md);
        `consumer_factory`, `clock` and `prepare` (topic and group set-up): the simulator's seams."""
        try:
            self.queue = check_queue_name(queue)
        except ValueError as error:
            raise QueueError(str(error)) from None
        self.config = config
        self.limits = limits or config.limits_for(queue)
        self.name = name or default_name()
        self._dead_letters = dead_letters
        self._instruments = instruments or QueueInstruments()
        self._consumer_factory, self._clock, self._prepare = consumer_factory, clock, prepare
        #: Tracing on: the span of each delivery handed out and not yet settled (delivery_spans.py).
        self.spans: DeliverySpans | NoSpans = DeliverySpans(tracer) if tracer is not None else NoSpans()
        self.topic = config.share_topic(queue)
        self._state = ShareState(self.queue, self.limits)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stopping = threading.Event()
        self._give_up = threading.Event()
        self._closed = False
        self._failure: BaseException | None = None
        self._consumer: Any = None
        self._poller: threading.Thread | None = None
        #: What the consumer waits for while Kafka is away (said once; waiting_for() for status and health).
        self._kafka = Outage(log, f"Consumer of share queue {self.queue}", clock, stall_after=clients.STALL_AFTER)
        #: Acknowledgements Kafka refused since that was last said (they come back as redeliveries), and when.
        self._refused = 0
        self._refusals_said = 0.0
        #: Asks whether Kafka answers again while waiting with nothing polled (made when first needed).
        self._admin: Any = None

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> ShareQueueConsumer:
        """Create the topic, configure the share group, join it and start polling; QueueError if not."""
        self.open()
        self._poller = threading.Thread(target=self._poll_loop, name=f"queue-share-{self.queue}", daemon=True)
        self._poller.start()
        log.info("Consuming share queue %s as %s (share group %s, topic %s, max %d in progress, lock %gs)",
                 self.queue, self.name, self.config.share_group(self.queue), self.topic,
                 self.limits.max_in_progress, self.limits.redelivery_timeout)
        return self

    def open(self) -> None:
        problems = self.config.validate() + self.limits.problems()
        if problems:
            raise QueueError("invalid queue configuration: " + "; ".join(map(str, problems)))
        try:
            self._prepare(self.config, self.queue, self.limits, KAFKA_START_TIMEOUT)
            self._consumer = self._new_client()
        except KafkaUnavailable as error:
            raise QueueError(str(error)) from None
        except KafkaException as error:
            bootstrap = self.config.base_kafka_config.get("bootstrap.servers", "?")
            raise QueueError(f"Kafka is unreachable at {bootstrap}: {kafka_reason(error)}") from None

    def _new_client(self) -> Any:
        consumer = self._consumer_factory(self._kafka.watch(clients.share_consumer_config(
            self.config, self.queue, self.name, self.limits)))
        consumer.subscribe([self.topic])
        consumer.set_acknowledgement_commit_callback(self._acknowledgements_committed)
        return consumer

    def waiting_for(self) -> tuple[str, float] | None:
        """What the consumer has been waiting for while Kafka is away, and for how many seconds; None if nothing."""
        waited = self._kafka.waited()
        return (self._kafka.what, waited) if self._kafka.since is not None else None

    def __enter__(self) -> ShareQueueConsumer:
        return self if self._poller is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def receive(self, timeout: float | None = None) -> Message | None:
        """The next message, waiting up to `timeout` seconds (None: forever); None if none came."""
        if self._closed:
            raise QueueError(f"consumer of queue {self.queue!r} is closed")
        delivery = wait_for_delivery(self._changed, self._state, self._clock, self._stopping, self._raise_failure,
                                     timeout)
        if delivery is None:
            return None
        try:
            with self._lock:
                self.spans.received(delivery)
            self._instruments.received(self.queue)
        except Exception:  # a span processor's or a metric's surprise: the delivery is taken, so hand it out
            log.exception("Tracing or metrics failed on a received message of queue %s (handled anyway)", self.queue)
        return Message(self, delivery)  # type: ignore[arg-type]  # the same protocol as QueueConsumer

    def close(self, timeout: float = 30.0) -> None:
        """Stop polling, release messages never received, wait up to `timeout` for the rest to be settled."""
        if self._closed:
            return
        released = self.stop_polling()
        deadline = self._clock() + timeout
        while self.in_progress and self._clock() < deadline and self._poller is not None and self._poller.is_alive():
            time.sleep(0.02)
        if self.in_progress:
            log.warning("Closing with %d message(s) of share queue %s unacknowledged: Kafka redelivers them when "
                        "this consumer has left the group", self.in_progress, self.queue)
        self._give_up.set()
        if self._poller is not None:
            self._poller.join()
        else:
            self._close_client()
        with self._lock:
            for delivery in list(self._state.held.values()):
                self.spans.finish(delivery, "unsettled")
        log.info("Closed consumer of share queue %s (received %d, acked %d, retried %d, released %d, "
                 "dead-lettered %d)", self.queue, self.received, self.acked, self.retried, released,
                 self.dead_lettered)

    # The steps of close() the simulator takes on its own clock: stop_polling(), then round() until
    # polling_done, then the client's close.

    def stop_polling(self) -> int:
        """No more polls; receive() raises from now on; messages never received go back (RELEASE). Returns how many."""
        self._closed = True
        self._stopping.set()
        with self._changed:
            released = self._state.release_buffered(self._clock())
            self._changed.notify_all()
        return released

    @property
    def polling_done(self) -> bool:
        """The poller's loop ends: given up, or stopping with every record of the last batch acknowledged."""
        return self._give_up.is_set() or (self._stopping.is_set() and self._state.batch_done)

    # -- figures ----------------------------------------------------------------------------------

    @property
    def in_progress(self) -> int:
        """Messages held: buffered, received or waiting for their acknowledgement to be sent."""
        return len(self._state.held)

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def oldest_in_progress(self) -> float | None:
        with self._lock:
            return self._state.oldest_received()

    received = property(lambda self: self._state.received)
    acked = property(lambda self: self._state.acked)
    retried = property(lambda self: self._state.retried)
    abandoned = property(lambda self: self._state.abandoned)
    released = property(lambda self: self._state.released)
    dead_lettered = property(lambda self: self._state.dead_lettered)
    redelivered = property(lambda self: self._state.redelivered)

    # -- settling (any thread) --------------------------------------------------------------------


    def _after_failure(self, message: Message) -> tuple[str, bool]:
        """What the broker does with an abandoned delivery, as share_state.verdict decides it: released for the broker
        to redeliver at once, or the last delivery dead-lettered. A redelivery comes within milliseconds, so a
        failing handler fails often: one line each, the traceback at DEBUG."""
        limit = self.limits.max_deliveries
        of = f" of {limit}" if limit is not None else ""
        decided = verdict(Outcome.ABANDONED, message.deliveries, self.limits, now=0.0, locked_at=0.0)
        if decided.dead_letter:
            return f"dead-lettered (delivery {message.deliveries}{of})", False
        return f"released: the broker redelivers it at once (delivery {message.deliveries}{of})", False
    def _settle(self, message: Message, kind: Kind | None, delay: float = 0.0) -> None:
        delivery: Delivery = message._delivery
        outcome = _OUTCOMES[kind]
        with self._changed:
            if self._state.settle(delivery, outcome, self._clock(), delay) is None:
                return
            self._changed.notify_all()
            self.spans.finish(delivery, outcome.value, delay if outcome is Outcome.RETRIED else None)
        if outcome is Outcome.ACKED:
            self._instruments.acked(self.queue, self._clock() - delivery.received_at)
        elif outcome is Outcome.RETRIED:
            self._instruments.retried(self.queue)
        else:
            self._instruments.abandoned(self.queue)

    # -- the poller (the only thread that calls the client) ------------------------------------------

    def _poll_loop(self) -> None:
        try:
            while not self.polling_done:
                self.round()
        except BaseException as error:
            self._fail(error)
        finally:
            self._close_client()

    def round(self) -> None:
        """Send what is due; then poll the next batch if the last one is settled, else wait for a verdict."""
        self._kafka.stalled()
        with self._lock:
            due = self._state.take_due(self._clock())
        if due:
            self._acknowledge(due)
        if self._state.batch_done:
            if not self._stopping.is_set():
                self._poll()
            return
        with self._changed:
            if self._state.due or self._give_up.is_set():
                return
            next_due = self._state.next_due()
            wait = self.config.poll_interval if next_due is None else max(0.0, min(
                self.config.poll_interval, next_due - self._clock()))
            self._changed.wait(wait)

    def _poll(self) -> None:
        try:
            records = self._consumer.poll(self.config.poll_interval)
        except KafkaException as error:
            kerror = kafka_error(error)
            if kerror is not None and kerror.code() == KafkaError.UNSUPPORTED_VERSION:
                raise QueueError(f"share queue {self.queue!r}: this Kafka has no share groups "
                                 f"({kafka_reason(error)}); the share backend needs Apache Kafka 4.2 or later"
                                 ) from None
            self._failed(error)
            return
        deliveries = []
        now = self._clock()
        for record in records:
            error = record.error()
            if error is not None:
                if error.fatal():
                    self._failed(KafkaException(error))
                    return
                log.warning("Share queue %s: %s", self.queue, error.str())
                continue
            deliveries.append(_delivery(record, now))
        if not deliveries:
            self._kafka.probe(self._ask_kafka)
            return
        self._kafka.resumed()
        redelivered = sum(d.deliveries > 1 for d in deliveries)
        if redelivered:
            self._instruments.redelivered(self.queue, redelivered)
        with self._changed:
            self._state.arrived(deliveries)
            if self._stopping.is_set():  # close() began while this poll ran: hand the batch back at once
                self._state.release_buffered(self._clock())
            self._changed.notify_all()

    def _acknowledge(self, due: list[Settling]) -> None:
        """Dead letters first (those that could not be written are tried again later, or RELEASEd), then the acks."""
        letters = [s for s in due if s.verdict.dead_letter]
        if letters:
            try:
                self._dead_letters([_dead_letter(self.queue, s.delivery) for s in letters])
            except Exception as error:
                with self._lock:
                    released = self._state.letters_failed(letters, self._clock())
                log.warning("Could not write %d dead letter(s) of share queue %s (%s): tried again while their "
                            "locks hold, %d released to come back", len(letters), self.queue, error, len(released))
                due = [s for s in due if not s.verdict.dead_letter] + released
                letters = []
        for settling in due:
            delivery = settling.delivery
            try:
                self._consumer.acknowledge_offset(self.topic, delivery.ref[0], delivery.ref[1],
                                                  _ACK_TYPES[settling.verdict.ack])
            except IllegalStateException as error:  # no longer in flight: Kafka has it back, and redelivers it
                log.warning("Could not acknowledge %s/%s (%s): Kafka redelivers it", self.queue, delivery.id, error)
            with self._lock:
                self._state.sent(settling, dead_lettered=settling.verdict.dead_letter)
        if letters:
            self._instruments.dead_lettered(self.queue, len(letters))
            log.warning("Moved %d message(s) of share queue %s to the dead letters (max deliveries reached)",
                        len(letters), self.queue)
        self._consumer.commit_async()
        with self._changed:
            self._changed.notify_all()

    def _ask_kafka(self, timeout: float) -> None:
        """A question any broker answers (the share client has none of its own to ask)."""
        if self._admin is None:
            self._admin = AdminClient(admin_config(self.config.base_kafka_config))
        self._admin.list_topics(self.topic, timeout=timeout)

    def _failed(self, error: KafkaException) -> None:
        """A poll that failed: waited through, the client replaced if it failed for good (its records come back
        when their locks end); only what no wait can fix ends the consumer."""
        if permanent(error):
            raise error
        self._kafka.waiting("Kafka", error)
        if fatal(error):
            log.warning("The share consumer of queue %s failed for good (%s): a new one takes over", self.queue,
                        kafka_reason(error))
            self._close_client()
            self._consumer = self._new_client()
            with self._lock:
                self._state.client_replaced()

    def _acknowledgements_committed(self, offsets: dict[Any, Any], error: KafkaException | None) -> None:
        """The broker's answer to acknowledgements (on the poller's thread): a refused one is redelivered. Kafka
        refuses some now and then (a share session that ended), many while a broker restarts: said at most every
        REFUSALS_SAID_EVERY seconds, with their count."""
        if error is None:
            self._kafka.resumed()
            return
        self._refused += sum(len(found) for found in offsets.values())
        now = self._clock()
        if now - self._refusals_said >= REFUSALS_SAID_EVERY or permanent(error):
            log.warning("Kafka refused %d acknowledgement(s) of share queue %s (%s): those messages are redelivered",
                        self._refused, self.queue, kafka_reason(error))
            self._refused, self._refusals_said = 0, now
        else:
            log.debug("Kafka refused acknowledgements of share queue %s (%s)", self.queue, kafka_reason(error))

    def _close_client(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is None:
            return
        try:
            consumer.close()  # commits what was acknowledged and leaves the group: the rest is redelivered
        except (KafkaException, RuntimeError) as error:
            log.warning("Closing the share consumer of queue %s: %s", self.queue, kafka_reason(error))

    def _fail(self, error: BaseException) -> None:
        if self._failure is None:
            self._failure = error
            log.error("Consumer of share queue %s failed: %s", self.queue, kafka_reason(error), exc_info=error)
        self._stopping.set()
        with self._changed:
            self._changed.notify_all()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            reason = str(self._failure) if isinstance(self._failure, QueueError) else kafka_reason(self._failure)
            raise QueueError(f"consumer of queue {self.queue!r} failed: {reason}") from self._failure


def _delivery(record: Any, now: float) -> Delivery:
    ref = (record.partition(), record.offset())
    headers = record.headers() or []
    return Delivery(ref=ref, id=markers.header_text(headers, markers.ID_HEADER) or markers.ref_id(ref),
                    key=record.key(), payload=record.value() or b"", raw_headers=headers,
                    deliveries=record.delivery_count() or 1, received_at=now, last_marker=now, state=Held.BUFFERED)


def _dead_letter(queue: str, delivery: Delivery) -> DeadLetter:
    return DeadLetter(queue=queue, message_id=delivery.id, key=delivery.key, payload=delivery.payload,
                      headers=[(k, v or b"") for k, v in delivery.raw_headers
                               if not k.startswith(markers.RESERVED_PREFIX)],
                      deliveries=delivery.deliveries, started=time.time())
