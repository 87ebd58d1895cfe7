"""Sends messages straight to the queue topic, with the idempotent producer (kafka-mq-go's scenario 1)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import KafkaError, Producer

from outbox.invalid import InvalidRecord
from outbox.kafka.names import default_name
from outbox.kafka.sizes import UNLIMITED, record_size
from outbox.queue.clients import sender_config
from outbox.queue.config import QueueConfig
from outbox.queue.errors import QueueError
from outbox.queue.instruments import QueueInstruments
from outbox.queue.markers import message_headers

log = logging.getLogger(__name__)
#: How often send() reads the topics' max.message.bytes again.
LIMIT_REFRESH_INTERVAL = 60.0
#: What a Start marker adds to a message (its marker headers and the record's key): the marker topic
#: must take it too.
START_MARKER_OVERHEAD = 256


class MessageTooLarge(InvalidRecord):
    """A message its queue's topics could not take (max.message.bytes): refused before it is produced."""

#: One message to send: (payload, the application's headers).
Outgoing = tuple[bytes, Sequence[tuple[str, bytes]]]


def new_message_id() -> str:
    return uuid.uuid4().hex


class QueueProducer:
    """Thread-safe; send() blocks until Kafka acknowledged every message or raises QueueError.

    `limit` is the smaller max.message.bytes of the queue topic and the markers topic (queue/topics.py),
    read again every LIMIT_REFRESH_INTERVAL through `read_limit`: batches fit it, and a message that
    could not (as itself, or as the Start marker that carries its payload) is refused before it is
    produced, with MessageTooLarge naming the limit.
    """

    def __init__(self, config: QueueConfig, *, instruments: QueueInstruments | None = None,
                 producer_factory: Callable[[dict[str, Any]], Any] = Producer, limit: int = UNLIMITED,
                 read_limit: Callable[[], int] | None = None) -> None:
        self.config = config
        self._instruments = instruments or QueueInstruments()
        self._factory = producer_factory
        self._name = default_name()
        self._lock = threading.Lock()
        self.limit = self._batch_limit = limit
        self._read_limit = read_limit
        self._limit_read_at = time.monotonic()
        kafka_config = sender_config(config, self._name, limit)
        self._producer = producer_factory(kafka_config)
        # librdkafka gives up after delivery.timeout.ms; wait a little longer so its report arrives first.
        self._timeout = float(kafka_config["delivery.timeout.ms"]) / 1000 + 5

    def send(self, queue: str, messages: Sequence[Outgoing], *, key: bytes | None = None,
             ids: Sequence[str] | None = None) -> list[str]:
        """Publish `messages` to `queue` (new ids unless given, e.g. to requeue a dead letter); returns the ids."""
        ids = list(ids) if ids is not None else [new_message_id() for _ in messages]
        self._refresh_limit()
        self._check_sizes(queue, messages, key, ids)
        producer = self._producer  # a producer rebuilt meanwhile (a lowered limit) serves later sends
        done = threading.Event()
        failures: list[KafkaError] = []
        pending = [len(messages)]
        lock = threading.Lock()

        def delivered(error: KafkaError | None, _message: Any) -> None:
            with lock:
                if error is not None:
                    failures.append(error)
                pending[0] -= 1
                if pending[0] == 0:
                    done.set()

        record_key = key if key is not None else queue.encode()
        topic = self.config.topic_for(queue)  # a share queue has a topic of its own
        deadline = time.monotonic() + self._timeout
        for message_id, (payload, headers) in zip(ids, messages, strict=True):
            while True:
                try:
                    producer.produce(topic, value=payload, key=record_key, on_delivery=delivered,
                                           headers=message_headers(headers, message_id=message_id, deliveries=1))
                    break
                except BufferError:  # librdkafka's local queue is full: let it drain
                    producer.poll(0.05)
                    if time.monotonic() > deadline:
                        raise QueueError(f"could not send to queue {queue!r}: the producer's queue "
                                         f"stayed full") from None
        while messages and not done.is_set():
            producer.poll(0.05)
            if time.monotonic() > deadline and not done.is_set():
                raise QueueError(f"could not send to queue {queue!r}: no acknowledgement from Kafka within "
                                 f"{self._timeout:g}s")
        if failures:
            raise QueueError(f"could not send {len(failures)} of {len(messages)} message(s) to queue {queue!r}: "
                             f"{failures[0].str()}")
        self._instruments.sent(queue, len(messages))
        return ids

    def close(self, timeout: float = 10.0) -> None:
        self._producer.flush(timeout)

    def _check_sizes(self, queue: str, messages: Sequence[Outgoing], key: bytes | None, ids: Sequence[str]) -> None:
        limit = self.limit
        if limit >= UNLIMITED:
            return
        record_key = key if key is not None else queue.encode()
        for index, (message_id, (payload, headers)) in enumerate(zip(ids, messages, strict=True)):
            size = record_size(record_key, payload, message_headers(headers, message_id=message_id, deliveries=1))
            if size + START_MARKER_OVERHEAD > limit:
                where = "payload" if len(messages) == 1 else f"payloads[{index}]"
                raise MessageTooLarge(where, f"too large for queue {queue!r}: {size:,} bytes as a message (and more "
                                             f"as the Start marker that carries it), while {self.config.topic} and "
                                             f"{self.config.markers_topic} take at most {limit:,} (max.message.bytes);"
                                             f" nothing was sent")

    def _refresh_limit(self) -> None:
        """Every LIMIT_REFRESH_INTERVAL: read the topics' limit again; a lowered one rebuilds the producer
        (after what it holds is delivered) so its batches fit."""
        if self._read_limit is None or time.monotonic() - self._limit_read_at < LIMIT_REFRESH_INTERVAL:
            return
        with self._lock:
            if time.monotonic() - self._limit_read_at < LIMIT_REFRESH_INTERVAL:
                return
            self._limit_read_at = time.monotonic()
            limit = self._read_limit()
            if limit != self.limit:
                log.warning("Queue topics %s and %s: max.message.bytes now %s bytes", self.config.topic,
                            self.config.markers_topic, "unknown" if limit >= UNLIMITED else f"{limit:,}")
            self.limit = limit
            if limit < self._batch_limit:
                old, self._producer = self._producer, self._factory(sender_config(self.config, self._name, limit))
                self._batch_limit = limit
                old.flush(self._timeout)
