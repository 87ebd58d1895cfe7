"""With tracing on, each delivery's span, kept beside the consumer's state machine (which knows nothing of
them), ended when the message is settled.

Markers backend: started with its Start marker, which carries the span's traceparent after the earlier
deliveries' (mq-trace-links, so a redelivery's span links to them all, in any process).
Share backend: started when receive() hands the delivery out. Kafka keeps nothing per delivery of a
share group's record (the redelivered record is the one first sent), so a redelivery's span can link
only to the earlier deliveries this process traced (SeenDeliveries); one handled elsewhere before has
no link, but its span has the same parent and messaging.message.id.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
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
        #: The share backend's links (received()); the markers backend's travel in its Start markers.
        self._seen = SeenDeliveries()

    def __bool__(self) -> bool:
        return bool(self._spans)

    def get(self, ref: Ref) -> Any:
        return self._spans.get(ref)

    def _open(self, delivery: Delivery, earlier: list[tuple[int, str]]) -> Any:
        span = self._tracer.started(delivery.ref, delivery.id, delivery.deliveries, delivery.raw_headers, earlier)
        self._spans[delivery.ref] = span
        return span

    def start(self, delivery: Delivery, marker: Marker) -> Marker:
        """Start the delivery's span; its Start marker, with the span's traceparent in mq-trace-links."""
        earlier = markers.trace_links(delivery.raw_headers)
        # The header keeps the newest MAX_TRACE_LINKS deliveries: number them back from this one.
        span = self._open(delivery, list(enumerate(earlier, start=max(1, delivery.deliveries - len(earlier)))))
        own = self._tracer.traceparent(span)
        if not own:
            return marker
        headers = [(k, v) for k, v in marker.headers if k != markers.TRACE_LINKS_HEADER]
        headers.append((markers.TRACE_LINKS_HEADER, ",".join([*earlier, own][-markers.MAX_TRACE_LINKS:]).encode()))
        return dataclasses.replace(marker, headers=tuple(headers))

    def received(self, delivery: Delivery) -> None:
        """Share backend: start the delivery's span, linked to the earlier deliveries this process traced."""
        span = self._open(delivery, self._seen.earlier(delivery.id))
        own = self._tracer.traceparent(span)
        if own:
            self._seen.add(delivery.id, delivery.deliveries, own)

    def finish(self, delivery: Delivery, outcome: str, delay: float | None = None) -> None:
        span = self._spans.pop(delivery.ref, None)
        if span is not None:
            self._tracer.finished(span, outcome, delay)

    def drop(self, deliveries: Iterable[Delivery]) -> None:
        """Deliveries that were never started (their Start transaction failed): their spans are not ended."""
        for delivery in deliveries:
            self._spans.pop(delivery.ref, None)


class SeenDeliveries:
    """The traceparents of the deliveries this process traced, by message id, for the newest `size` messages:
    the share backend's links (a few hundred bytes a message; the oldest forgotten first)."""

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._by_id: OrderedDict[str, list[tuple[int, str]]] = OrderedDict()

    def earlier(self, message_id: str) -> list[tuple[int, str]]:
        """(delivery number, traceparent) of the message's deliveries seen here, oldest first."""
        return list(self._by_id.get(message_id, ()))

    def add(self, message_id: str, delivery: int, traceparent: str) -> None:
        seen = self._by_id.pop(message_id, [])
        seen.append((delivery, traceparent))
        self._by_id[message_id] = seen[-markers.MAX_TRACE_LINKS:]
        while len(self._by_id) > self._size:
            self._by_id.popitem(last=False)


class NoSpans:
    """Tracing off: nothing is kept, and Start markers go as they are."""

    def __bool__(self) -> bool:
        return False

    def get(self, ref: Ref) -> None:
        return None

    def start(self, delivery: Delivery, marker: Marker) -> Marker:
        return marker

    def received(self, delivery: Delivery) -> None:
        pass

    def finish(self, delivery: Delivery, outcome: str, delay: float | None = None) -> None:
        pass

    def drop(self, deliveries: Iterable[Delivery]) -> None:
        pass
