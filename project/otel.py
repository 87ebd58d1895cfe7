"""An OpenTelemetry SDK for the example project's processes, chosen by OUTBOX_EXAMPLE_OTEL.

    console   spans printed to stdout as JSON (to see a trace by hand)
    discard   spans made, batched and dropped (what the benchmarks measure: the cost of making them)

A real project configures its SDK and exporter its own way (opentelemetry-instrument, or code
like this in settings or wsgi.py); the outbox only uses opentelemetry-api.
"""

from __future__ import annotations


def configure(kind: str) -> None:
    if kind not in {"console", "discard"}:
        raise ValueError(f"OUTBOX_EXAMPLE_OTEL must be 'console' or 'discard', got {kind!r}")
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SpanExportResult

    class Discard(SpanExporter):
        def export(self, spans: object) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider(resource=Resource.create({"service.name": "outbox-example"}))
    provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter() if kind == "console" else Discard()))
    trace.set_tracer_provider(provider)
