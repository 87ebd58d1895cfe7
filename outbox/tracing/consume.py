"""A queue consumer's spans: one per delivery of a message, from the consumer taking it (its Start
marker; on the share backend, receive() handing it out) to its ack, retry, abandon or release.
Imports opentelemetry: only used once tracing is on.

    process emails         CONSUMER, child of the trace context the message carries (the one
      stash() or send() added), linked to the spans of the message's earlier deliveries, with
      outbox.queue.deliveries = the delivery count. The markers backend carries their traceparents
      in the queue's own mq-trace-links header (the redelivery tracker copies it from the Start
      marker); the share backend has only those its own process traced (delivery_spans.py).

The handler runs with the span current (runner.py, or `trace.use_span(message.span)` when an
application calls receive() itself), so whatever it does (a stash() included) joins the trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from outbox.tracing.propagation import extract

TRACER_NAME = "outbox.queue"
#: Earlier deliveries linked at most (the newest kept): a message redelivered forever stays small.
MAX_LINKS = 16
_TRACECONTEXT = TraceContextTextMapPropagator()


class QueueTracer:
    """Spans for the deliveries of one consumer's queue."""

    def __init__(self, queue: str, topic: str, group: str, tracer_provider: Any = None) -> None:
        self.queue, self.topic, self.group = queue, topic, group
        self._tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)

    def started(self, ref: tuple[int, int], message_id: str, deliveries: int, raw_headers: Any,
                earlier: Sequence[tuple[int, str]]) -> Any:
        """The span of this delivery (not current yet); `earlier`: (delivery number, traceparent) of earlier ones."""
        links = []
        for number, traceparent in earlier[-MAX_LINKS:]:
            context = trace.get_current_span(_TRACECONTEXT.extract({"traceparent": traceparent})).get_span_context()
            if context.is_valid:
                links.append(Link(context, {"outbox.queue.delivery": number}))
        attributes = {
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": self.topic,
            "messaging.consumer.group.name": self.group,
            "messaging.message.id": message_id,
            "messaging.destination.partition.id": str(ref[0]),
            "messaging.kafka.offset": ref[1],
            "outbox.queue.name": self.queue,
            "outbox.queue.deliveries": deliveries,
        }
        return self._tracer.start_span(f"process {self.queue}", context=extract(raw_headers),
                                       kind=SpanKind.CONSUMER, attributes=attributes, links=links)

    @staticmethod
    def traceparent(span: Any) -> str | None:
        """The span's W3C traceparent, for the next delivery's link."""
        carrier: dict[str, str] = {}
        _TRACECONTEXT.inject(carrier, context=trace.set_span_in_context(span))
        return carrier.get("traceparent")

    @staticmethod
    def finished(span: Any, outcome: str, delay: float | None = None) -> None:
        """End the delivery's span: acked, retried (after `delay`), abandoned or released."""
        if outcome != "acked":
            attributes: dict[str, Any] = {} if delay is None else {"outbox.queue.retry_delay": delay}
            span.add_event(f"outbox.queue.{outcome}", attributes)
        span.set_attribute("outbox.queue.outcome", outcome)
        span.end()


def activate(span: Any) -> Any:
    """A context manager making the delivery's span current while the handler runs (it does not end it)."""
    return trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False)


def handler_failed(span: Any, error: BaseException) -> None:
    """The handler raised: the delivery's span says so."""
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
