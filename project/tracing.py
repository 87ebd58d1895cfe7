"""The example shop's request spans, so a trace starts at the order view (docs/tracing.md).

A real project would use opentelemetry-instrumentation-django and an exporter of its choice; this
keeps the example to opentelemetry-api: a SERVER span per request, current while the view runs,
so the view's stash() and queue.stash() carry its context into the outbox. Without
opentelemetry-api installed, or with OUTBOX["tracing"] False, it only passes requests through.
"""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

from outbox.tracing.switch import tracing_on


class RequestSpanMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not tracing_on():
            return self.get_response(request)
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        tracer = trace.get_tracer("project.shop")
        with tracer.start_as_current_span(f"{request.method} {request.path}", kind=SpanKind.SERVER,
                                          attributes={"http.request.method": request.method,
                                                      "url.path": request.path}) as span:
            response = self.get_response(request)
            span.set_attribute("http.response.status_code", response.status_code)
            if response.status_code >= 500:
                span.set_status(Status(StatusCode.ERROR))
            return response
