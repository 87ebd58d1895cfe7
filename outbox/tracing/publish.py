"""The harvester's spans, following OpenTelemetry's messaging conventions. Importing this module
imports opentelemetry: only done when tracing is on.

One span per batch of records a Send produces to one topic (not one per record: a span costs the
engine about as much as publishing a record does, so per-record spans would halve a drain; see
docs/benchmarks.md). At a steady trickle a batch is one record, and its span is the record's own.

    send orders            PRODUCER
      messaging.system=kafka, messaging.operation.type=send, messaging.destination.name=orders,
      outbox.wait.duration (seconds from the oldest record's create time to the produce call);
      one record: messaging.message.id (the outbox id), messaging.kafka.message.key, and once
      acknowledged messaging.destination.partition.id and messaging.kafka.offset;
      several: messaging.batch.message_count.
      Parent: the trace context stash() stored in the records' headers when they all share one
      (the common case of one request's records); otherwise a link to each distinct context.
      A failed delivery: status ERROR, error.type and an `exception` event naming the record;
      a hold after it: an `outbox.hold` event. Ends when every record of the batch is settled.
    park orders            INTERNAL, child of the record's context, when a record is parked.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from outbox.harvest.commands import DeliveryError
from outbox.harvest.contract import Record
from outbox.tracing.propagation import extract

TRACER_NAME = "outbox.harvest"
#: Links kept on one span at most (OpenTelemetry's default span link limit).
MAX_LINKS = 128
_W3C_FIELDS = frozenset({"traceparent", "tracestate", "baggage"})


_create_time = attrgetter("create_time")


class _Batch:
    """One span and a count of its records settled, which ends the span with the last one.

    Records settle on two threads (the delivery thread acknowledges, the engine thread ends what was
    never produced): `next()` on an itertools.count is one C call under the GIL, so each settle gets
    its own number without a lock (a lock per record measured as a tenth of the tracer's cost)."""

    __slots__ = ("last", "settled", "single", "span")

    def __init__(self, span: Any, size: int) -> None:
        self.span, self.single, self.last = span, size == 1, size - 1
        self.settled = itertools.count()


class OtelPublishTracer:
    """outbox.harvest.tracing.PublishTracer over OpenTelemetry's global (or a given) tracer provider."""

    def __init__(self, tracer_provider: Any = None) -> None:
        self._tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)
        fields = propagate.get_global_textmap().fields
        #: With the default propagators, a record's context is read from its traceparent header directly
        #: (the cheap path); other propagators (B3, Jaeger...) are asked for records that have their headers.
        self._w3c = set(fields) <= _W3C_FIELDS
        self._fields = frozenset(fields)

    # -- PublishTracer ----------------------------------------------------------------------------

    def sending(self, records: Sequence[Record]) -> Sequence[Any]:
        if len(records) == 1 or len({r.topic for r in records}) == 1:
            return [self._start(records)] * len(records)
        by_topic: dict[str, list[int]] = {}
        for index, record in enumerate(records):
            by_topic.setdefault(record.topic, []).append(index)
        handles: list[Any] = [None] * len(records)
        for indexes in by_topic.values():
            batch = self._start([records[i] for i in indexes])
            for i in indexes:
                handles[i] = batch
        return handles

    def acknowledged(self, handle: _Batch, message: Any) -> None:
        if handle.single:
            handle.span.set_attributes({"messaging.destination.partition.id": str(message.partition()),
                                        "messaging.kafka.offset": message.offset()})
        if next(handle.settled) == handle.last:
            handle.span.end()

    def failed(self, handle: _Batch, record_id: int, error: DeliveryError) -> None:
        span = handle.span
        span.set_attribute("error.type", error.code)
        span.add_event("exception", {"exception.type": error.code, "exception.message": error.message,
                                     "messaging.message.id": str(record_id),
                                     "outbox.error.permanent": error.permanent})
        span.set_status(Status(StatusCode.ERROR, str(error)))

    def held(self, handle: _Batch, record_id: int, reason: str) -> None:
        handle.span.add_event("outbox.hold", {"messaging.message.id": str(record_id), "outbox.hold.reason": reason})

    def end(self, handle: _Batch) -> None:
        if next(handle.settled) == handle.last:
            handle.span.end()

    def parked(self, record: Record, reason: str, attempts: int, topic: str | None) -> None:
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
        with self._tracer.start_as_current_span(f"park {record.topic}", context=self._context_of(record),
                                                kind=SpanKind.INTERNAL, attributes=attributes) as span:
            span.set_status(Status(StatusCode.ERROR, f"parked after {attempts} attempt(s): {reason}"))

    # -- the span of a batch ----------------------------------------------------------------------

    def _start(self, records: Sequence[Record]) -> _Batch:
        first = records[0]
        start = time.time_ns()
        attributes: dict[str, Any] = {"messaging.system": "kafka", "messaging.operation.type": "send",
                                      "messaging.destination.name": first.topic}
        if len(records) == 1:
            attributes["messaging.message.id"] = str(first.id)
            attributes["messaging.kafka.message.key"] = first.key
        else:
            attributes["messaging.batch.message_count"] = len(records)
        oldest = min(filter(None, map(_create_time, records)), default=None)
        if oldest is not None:
            attributes["outbox.wait.duration"] = max(0.0, start / 1e9 - oldest.timestamp())
        contexts = self._w3c_contexts(records) if self._w3c else self._contexts(records)
        parent = None
        links: list[Link] = []
        if len(contexts) == 1:
            [context] = contexts.values()
            parent = trace.set_span_in_context(NonRecordingSpan(context))
        else:
            # No attributes on the links: each would be a locked dict of its own, kept with the span
            # until exported, and a drain's batches carry up to 128 links each.
            links = [Link(context) for context in contexts.values()]
        span = self._tracer.start_span(f"send {first.topic}", context=parent, kind=SpanKind.PRODUCER,
                                       attributes=attributes, links=links, start_time=start)
        return _Batch(span, len(records))

    @staticmethod
    def _w3c_contexts(records: Sequence[Record]) -> dict[Any, SpanContext]:
        """The records' distinct stash-time span contexts (at most MAX_LINKS), read from their W3C
        headers; each distinct header is parsed once. This loop runs for every record a traced
        harvester publishes: keep it lean."""
        contexts: dict[Any, SpanContext] = {}
        previous: Any = None
        for record in records:
            keys = record.header_keys
            if not keys:
                continue
            parent = header_index(keys, "traceparent")
            if parent is None:
                continue
            values = record.header_values
            state = header_index(keys, "tracestate")
            key = (values[parent], None if state is None else values[state])
            if key == previous or key in contexts:  # a request's records come together: mostly the former
                continue
            previous = key
            context = parse_traceparent(*key)
            if context is not None:
                contexts[key] = context
                if len(contexts) == MAX_LINKS:
                    break
        return contexts

    def _contexts(self, records: Sequence[Record]) -> dict[Any, SpanContext]:
        """The same through the configured propagator (B3, Jaeger...): for records that have its headers."""
        contexts: dict[Any, SpanContext] = {}
        for record in records:
            if not record.header_keys or self._fields.isdisjoint(name.lower() for name in record.header_keys):
                continue
            context = trace.get_current_span(self._context_of(record)).get_span_context()
            if context.is_valid and (context.trace_id, context.span_id) not in contexts:
                contexts[(context.trace_id, context.span_id)] = context
                if len(contexts) == MAX_LINKS:
                    break
        return contexts

    @staticmethod
    def _context_of(record: Record) -> Any:
        return extract(zip(record.header_keys, record.header_values, strict=False)) if record.header_keys else None


def header_index(keys: list[str], name: str) -> int | None:
    """Where header `name` (lower case) is among a record's header names, compared without case as stash() compares
    them (a caller's `TraceParent` is the record's context); the first of a repeated name; None if absent."""
    if name in keys:  # as stash() writes it: the common case, and the cheap one
        return keys.index(name)
    size = len(name)
    for key in keys:  # a plain loop: about 0.4 us a record that has headers and no context
        if len(key) == size and key.lower() == name:
            return keys.index(key)
    return None


_FLAGS = [TraceFlags(value) for value in range(256)]


def parse_traceparent(traceparent: str, tracestate: str | None = None) -> SpanContext | None:
    """A remote SpanContext from a W3C traceparent (version 00 and later versions' first four fields),
    or None if it is malformed or all zeros. Called once per distinct context a traced Send carries
    (a split and int() measured faster than OpenTelemetry's regular expression)."""
    parts = traceparent.strip().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff" or len(parts[1]) != 32 or len(parts[2]) != 16 \
            or len(parts[3]) != 2 or (parts[0] == "00" and len(parts) != 4):
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    state = None
    if tracestate:
        try:
            state = TraceState.from_header([tracestate])
        except ValueError:
            state = None
    return SpanContext(trace_id, span_id, True, _FLAGS[flags & 0xFF], state)
