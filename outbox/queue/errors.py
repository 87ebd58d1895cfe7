"""Errors of the queue's clients, and the exception a handler raises to ask for a redelivery."""

from __future__ import annotations

from outbox.kafka.redaction import scrub


class QueueError(Exception):
    """A queue client cannot start, send or go on; str() is one line for the operator, with any secret
    value a client's error quoted masked."""

    def __init__(self, message: str = "") -> None:
        super().__init__(scrub(str(message)))


class Retry(Exception):
    """Raised by a handler: no ack, and redeliver the message after `delay` seconds (0: at once).

    The redelivery counts as a delivery, so max_deliveries still ends a message that always retries.
    """

    def __init__(self, reason: str = "", *, delay: float = 0.0) -> None:
        if isinstance(delay, bool) or not isinstance(delay, int | float) or not 0 <= delay <= 12 * 3600:
            raise ValueError(f"delay: must be from 0 to 43200 seconds, got {delay!r}")
        super().__init__(reason or f"retry in {delay:g}s")
        self.delay = float(delay)
