"""Sends messages straight to the queue topic, with the idempotent producer (kafka-mq-go's scenario 1)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import KafkaError, Producer

from outbox.harvest.config import default_name
from outbox.queue.clients import sender_config
from outbox.queue.config import QueueConfig
from outbox.queue.errors import QueueError
from outbox.queue.instruments import QueueInstruments
from outbox.queue.markers import message_headers

log = logging.getLogger(__name__)

#: One message to send: (payload, the application's headers).
Outgoing = tuple[bytes, Sequence[tuple[str, bytes]]]


def new_message_id() -> str:
    return uuid.uuid4().hex


class QueueProducer:
    """Thread-safe; send() blocks until Kafka acknowledged every message or raises QueueError."""

    def __init__(self, config: QueueConfig, *, instruments: QueueInstruments | None = None,
                 producer_factory: Callable[[dict[str, Any]], Any] = Producer) -> None:
        self.config = config
        self._instruments = instruments or QueueInstruments()
        kafka_config = sender_config(config, default_name())
        self._producer = producer_factory(kafka_config)
        # librdkafka gives up after delivery.timeout.ms; wait a little longer so its report arrives first.
        self._timeout = float(kafka_config["delivery.timeout.ms"]) / 1000 + 5

    def send(self, queue: str, messages: Sequence[Outgoing], *, key: bytes | None = None,
             ids: Sequence[str] | None = None) -> list[str]:
        """Publish `messages` to `queue` (new ids unless given, e.g. to requeue a dead letter); returns the ids."""
        ids = list(ids) if ids is not None else [new_message_id() for _ in messages]
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
        deadline = time.monotonic() + self._timeout
        for message_id, (payload, headers) in zip(ids, messages, strict=True):
            while True:
                try:
                    self._producer.produce(self.config.topic, value=payload, key=record_key, on_delivery=delivered,
                                           headers=message_headers(headers, message_id=message_id, deliveries=1))
                    break
                except BufferError:  # librdkafka's local queue is full: let it drain
                    self._producer.poll(0.05)
                    if time.monotonic() > deadline:
                        raise QueueError(f"could not send to queue {queue!r}: the producer's queue "
                                         f"stayed full") from None
        while messages and not done.is_set():
            self._producer.poll(0.05)
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
