"""The harvester's spans: one per published record (not per batch: each record has its own parent, the
trace it was stashed in, and its own partition and offset), following OpenTelemetry's messaging
conventions. Importing this module imports opentelemetry: only done when tracing is on.

    send orders            PRODUCER, child of the context stash() stored in the record's headers
      messaging.system=kafka, messaging.operation.type=send, messaging.destination.name=orders,
      messaging.message.id=<outbox id>, messaging.kafka.message.key, outbox.wait.duration (seconds
      from the row's create time to the produce call), then messaging.destination.partition.id and
      messaging.kafka.offset once acknowledged; a failed delivery sets error.type and status ERROR
      with an exception event; a hold after it adds an `outbox.hold` event.
    park orders            INTERNAL, child of the same context, when the record is parked.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from outbox.harvest.commands import DeliveryError
from outbox.harvest.contract import Record
from outbox.tracing.propagation import extract

TRACER_NAME = "outbox.harvest"


class OtelPublishTracer:
    """outbox.harvest.tracing.PublishTracer over OpenTelemetry's global (or a given) tracer provider."""

    def __init__(self, tracer_provider: Any = None) -> None:
        self._tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)

    def sending(self, record: Record) -> Any:
        parent = extract(zip(record.header_keys, record.header_values, strict=False)) if record.header_keys else None
        start = time.time_ns()
        attributes: dict[str, Any] = {
            "messaging.system": "kafka",
            "messaging.operation.type": "send",
            "messaging.operation.name": "send",
            "messaging.destination.name": record.topic,
            "messaging.message.id": str(record.id),
            "messaging.kafka.message.key": record.key,
        }
        if record.value is None:
            attributes["messaging.kafka.message.tombstone"] = True
        if record.create_time is not None:
            attributes["outbox.wait.duration"] = max(0.0, start / 1e9 - record.create_time.timestamp())
        return self._tracer.start_span(f"send {record.topic}", context=parent, kind=SpanKind.PRODUCER,
                                       attributes=attributes, start_time=start)

    def acknowledged(self, span: Any, message: Any) -> None:
        span.set_attribute("messaging.destination.partition.id", str(message.partition()))
        span.set_attribute("messaging.kafka.offset", message.offset())
        span.end()

    def failed(self, span: Any, error: DeliveryError) -> None:
        span.set_attribute("error.type", error.code)
        span.add_event("exception", {"exception.type": error.code, "exception.message": error.message,
                                     "outbox.error.permanent": error.permanent})
        span.set_status(Status(StatusCode.ERROR, str(error)))

    def held(self, span: Any, reason: str) -> None:
        span.add_event("outbox.hold", {"outbox.hold.reason": reason})

    def end(self, span: Any) -> None:
        span.end()

    def parked(self, record: Record, reason: str, attempts: int, topic: str | None) -> None:
        parent = extract(zip(record.header_keys, record.header_values, strict=False)) if record.header_keys else None
        attributes: dict[str, Any] = {
            "messaging.system": "kafka",
            "messaging.destination.name": record.topic,
            "messaging.message.id": str(record.id),
            "messaging.kafka.message.key": record.key,
            "outbox.park.reason": reason,
            "outbox.park.attempts": attempts,
        }
        if topic is not None:
            attributes["outbox.dead_letter.topic"] = topic
        with self._tracer.start_as_current_span(f"park {record.topic}", context=parent, kind=SpanKind.INTERNAL,
                                                attributes=attributes) as span:
            span.set_status(Status(StatusCode.ERROR, f"parked after {attempts} attempt(s): {reason}"))
