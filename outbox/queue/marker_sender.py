"""The markers a queue consumer sends outside a transaction: End (ack), KeepAlive (keep-alives and retry),
Release (close), on an idempotent producer of their own.

A marker goes to the markers partition its message's Start marker went to (when known), so the tracker reads
a message's markers in order. A full local queue is polled once and tried again; a producer that failed for
good is replaced and the marker goes out on the new one; any other refusal is said in one line, and the
message is then redelivered after its timeout, which is what a lost marker costs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from outbox.kafka.outage import fatal
from outbox.queue import markers
from outbox.queue.markers import Marker
from outbox.reasons import kafka_reason

log = logging.getLogger("outbox.queue.markers_consumer")


class MarkerSender:
    """One queue consumer's marker producer: send, poll for delivery reports, flush at close."""

    def __init__(self, queue: str, topic: str, new_producer: Callable[[], Any]) -> None:
        """`new_producer()`: an idempotent producer for the markers topic (made again after a fatal error)."""
        self.queue, self.topic = queue, topic
        self._key = queue.encode()
        self._new_producer = new_producer
        self._producer: Any = new_producer()

    def send(self, marker: Marker, partition: int | None, message_id: str) -> None:
        """Send `marker` (to `partition` if known); a failure is logged, never raised (module docstring)."""
        value, headers = markers.encode(marker)
        where: dict[str, Any] = {} if partition is None else {"partition": partition}

        def produce() -> None:
            self._producer.produce(self.topic, key=self._key, value=value, headers=headers,
                                   on_delivery=self._delivered, **where)

        try:
            try:
                produce()
            except BufferError:
                self._producer.poll(0.1)
                produce()
            except KafkaException as error:
                if not fatal(error):
                    raise
                log.warning("The marker producer of queue %s failed for good (%s): a new one takes over", self.queue,
                            kafka_reason(error))
                self._producer = self._new_producer()
                produce()
        except KafkaException as error:
            log.warning("Could not send a %s marker for %s/%s: %s", marker.kind.value, self.queue, message_id,
                        kafka_reason(error))

    def poll(self, timeout: float) -> None:
        """Serve delivery reports (the keep-alive thread calls it between rounds)."""
        self._producer.poll(timeout)

    def close(self, timeout: float = 10) -> None:
        """Flush what is still to be delivered, for up to `timeout` seconds, saying how many were not."""
        remaining = self._producer.flush(timeout)
        if remaining:
            log.warning("%d marker(s) of queue %s not delivered at close", remaining, self.queue)

    def _delivered(self, error: KafkaError | None, record: Any) -> None:
        if error is not None:
            log.warning("A marker of queue %s was not delivered (%s): its message may be redelivered", self.queue,
                        error.str())
