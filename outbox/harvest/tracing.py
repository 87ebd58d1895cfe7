"""The hook the driver calls around each published record, so spans can be made without the engine
importing OpenTelemetry (outbox/tracing/publish.py implements it). The core never sees it: tracing
changes no decision, order or delivery.

Calls come from the engine thread (sending, held, end), the delivery thread (acknowledged, failed)
and the fence session's thread (parked): keep them cheap and thread-safe.
"""

from __future__ import annotations

from typing import Any, Protocol

from outbox.harvest.commands import DeliveryError
from outbox.harvest.contract import Record


class PublishTracer(Protocol):
    def sending(self, record: Record) -> Any:
        """The record is about to be produced: start its span and return it."""

    def acknowledged(self, span: Any, message: Any) -> None:
        """Kafka acknowledged it (`message` has partition() and offset()): finish the span."""

    def failed(self, span: Any, error: DeliveryError) -> None:
        """Its delivery failed or the producer refused it: record that (end() follows)."""

    def held(self, span: Any, reason: str) -> None:
        """The core held the record after that failure (its key waits)."""

    def end(self, span: Any) -> None:
        """Finish a span that failed() or was never produced."""

    def parked(self, record: Record, reason: str, attempts: int, topic: str | None) -> None:
        """The record was moved to the dead-letter table (and `topic`, if any)."""
