"""With tracing on, each delivery's span, kept beside the consumer's state machine (which knows nothing of
them): started with its Start marker, which carries the span's traceparent after the earlier deliveries'
(mq-trace-links, so a redelivery's span links to them all), ended when the message is settled."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from outbox.queue import markers
from outbox.queue.consumer_state import Delivery
from outbox.queue.markers import Marker, Ref


class DeliverySpans:
    """The spans of the deliveries a consumer holds, by ref; `tracer` is an outbox.tracing.consume.QueueTracer."""

    def __init__(self, tracer: Any) -> None:
        self._tracer = tracer
        self._spans: dict[Ref, Any] = {}

    def __bool__(self) -> bool:
        return bool(self._spans)

    def get(self, ref: Ref) -> Any:
        return self._spans.get(ref)

    def start(self, delivery: Delivery, marker: Marker) -> Marker:
        """Start the delivery's span; its Start marker, with the span's traceparent in mq-trace-links."""
        earlier = markers.trace_links(delivery.raw_headers)
        span = self._tracer.started(delivery.ref, delivery.id, delivery.deliveries, delivery.raw_headers, earlier)
        self._spans[delivery.ref] = span
        own = self._tracer.traceparent(span)
        if not own:
            return marker
        headers = [(k, v) for k, v in marker.headers if k != markers.TRACE_LINKS_HEADER]
        headers.append((markers.TRACE_LINKS_HEADER, ",".join([*earlier, own][-markers.MAX_TRACE_LINKS:]).encode()))
        return dataclasses.replace(marker, headers=tuple(headers))

    def finish(self, delivery: Delivery, outcome: str, delay: float | None = None) -> None:
        span = self._spans.pop(delivery.ref, None)
        if span is not None:
            self._tracer.finished(span, outcome, delay)

    def drop(self, deliveries: Iterable[Delivery]) -> None:
        """Deliveries that were never started (their Start transaction failed): their spans are not ended."""
        for delivery in deliveries:
            self._spans.pop(delivery.ref, None)


class NoSpans:
    """Tracing off: nothing is kept, and Start markers go as they are."""

    def __bool__(self) -> bool:
        return False

    def get(self, ref: Ref) -> None:
        return None

    def start(self, delivery: Delivery, marker: Marker) -> Marker:
        return marker

    def finish(self, delivery: Delivery, outcome: str, delay: float | None = None) -> None:
        pass

    def drop(self, deliveries: Iterable[Delivery]) -> None:
        pass
