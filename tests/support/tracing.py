"""One OpenTelemetry SDK tracer provider for the test process, exporting to memory.

OpenTelemetry lets a process set its global provider once, so every tracing test shares this one
and starts from a cleared exporter (the `spans` fixture in the tests that use it). Spans are kept
only while a tracing test runs (`recording`), so the tests after it do not fill the exporter.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

EXPORTER = InMemorySpanExporter()
PROVIDER = TracerProvider()


class _WhileRecording(SimpleSpanProcessor):
    recording = False

    def on_end(self, span: ReadableSpan) -> None:
        if self.recording:
            super().on_end(span)


PROCESSOR = _WhileRecording(EXPORTER)
PROVIDER.add_span_processor(PROCESSOR)


def install() -> InMemorySpanExporter:
    """Make PROVIDER the global one (once) and return its cleared exporter, recording."""
    if trace.get_tracer_provider() is not PROVIDER:
        trace.set_tracer_provider(PROVIDER)
    EXPORTER.clear()
    PROCESSOR.recording = True
    return EXPORTER


def uninstall() -> None:
    """Stop keeping spans and drop those kept."""
    PROCESSOR.recording = False
    EXPORTER.clear()


def named(spans: tuple[ReadableSpan, ...] | list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def traceparent_of(span: ReadableSpan) -> str:
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def render(spans: tuple[ReadableSpan, ...] | list[ReadableSpan], trace_id: int) -> str:
    """One trace as an indented text tree, times in ms from its first span (for docs/tracing.md)."""
    mine = sorted((s for s in spans if s.context.trace_id == trace_id), key=lambda s: s.start_time)
    origin = mine[0].start_time
    children: dict[int | None, list[ReadableSpan]] = {}
    ids = {s.context.span_id for s in mine}
    for span in mine:
        parent = span.parent.span_id if span.parent is not None and span.parent.span_id in ids else None
        children.setdefault(parent, []).append(span)
    shown = ("messaging.destination.name", "messaging.message.id", "messaging.destination.partition.id",
             "messaging.kafka.offset", "outbox.wait.duration", "outbox.queue.deliveries", "http.response.status_code")
    lines: list[str] = []

    def walk(span: ReadableSpan, depth: int) -> None:
        start = (span.start_time - origin) / 1e6
        took = (span.end_time - span.start_time) / 1e6
        facts = []
        for name in shown:
            if name in span.attributes:
                value = span.attributes[name]
                facts.append(f"{name}={value * 1000:.1f}ms" if name == "outbox.wait.duration" else f"{name}={value}")
        links = f" links={len(span.links)}" if span.links else ""
        lines.append(f"{'  ' * depth}{span.name} [{span.kind.name}] +{start:.1f}ms {took:.1f}ms"
                     f"{links} {' '.join(facts)}".rstrip())
        for child in children.get(span.context.span_id, []):
            walk(child, depth + 1)

    for root in children.get(None, []):
        walk(root, 0)
    return "\n".join(lines)
