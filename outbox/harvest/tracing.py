"""The hook the driver calls around each published record, so spans can be made without the engine
importing OpenTelemetry (outbox/tracing/publish.py implements it). The core never sees it: tracing
changes no decision, order or delivery.

Calls come from the engine thread (sending, held, end), the delivery thread (acknowledged, failed)
and the fence session's thread (parked): keep them cheap and thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from outbox.harvest.commands import DeliveryError
from outbox.harvest.contract import Record


class PublishTracer(Protocol):
    """Each record of a Send gets a handle; every handle is settled exactly once, by acknowledged()
    or by end() (after failed(), or when the record was not produced after all)."""

    def sending(self, records: Sequence[Record]) -> Sequence[Any]:
        """A Send's records are about to be produced: start their span(s); a handle per record."""

    def acknowledged(self, handle: Any, message: Any) -> None:
        """Kafka acknowledged the record (`message` has partition() and offset())."""

    def failed(self, handle: Any, record_id: int, error: DeliveryError) -> None:
        """Its delivery failed or the producer refused it: record that (end() follows)."""

    def held(self, handle: Any, record_id: int, reason: str) -> None:
        """The core held the record after that failure (its key waits)."""

    def end(self, handle: Any) -> None:
        """The record is settled without an acknowledgement (failed, or never produced)."""

    def parked(self, record: Record, reason: str, attempts: int, topic: str | None) -> None:
        """The record was moved to the dead-letter table (and `topic`, if any)."""
