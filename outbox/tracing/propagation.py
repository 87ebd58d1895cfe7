"""Trace context in and out of message headers, through OpenTelemetry's configured propagator.

Only called once tracing is on (switch.py): the first call imports opentelemetry. No Django here,
so the harvester and a queue consumer outside Django use the same functions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from outbox.harvest.contract import Record

#: opentelemetry's trace and propagate modules, imported by the first call (see _otel).
_modules: tuple[Any, Any] | None = None
_context: Any = None
#: The last context propagated, the propagator and the headers: a request's stash() calls propagate it once.
_last: tuple[Any, Any, list[tuple[str, str]]] | None = None


def _otel() -> tuple[Any, Any]:
    global _modules, _context
    if _modules is None:
        from opentelemetry import context, propagate, trace

        _modules, _context = (trace, propagate), context
    return _modules


def inject_into(record: Record) -> None:
    """Add the current span's context to a cleaned record's headers (traceparent, tracestate and, if
    the propagator is configured for it, baggage). Headers the caller set are kept: a name the
    record already has is not added again. Nothing is added when no span is current."""
    add_headers(record, current_headers())


def add_headers(record: Record, pairs: list[tuple[str, str]]) -> None:
    """Append `pairs` to a cleaned record's headers, except names it has already (compared without case)."""
    if not pairs:
        return
    keys = record.header_keys
    taken = {name.lower() for name in keys} if keys else ()
    for name, value in pairs:
        if name.lower() not in taken:
            keys.append(name)
            record.header_values.append(value)


def current_headers() -> list[tuple[str, str]]:
    """The current span's context as (name, value) pairs through the configured propagator; empty when
    no span is current. Read once per stash_many() call: every record of it shares the context."""
    global _last
    trace, propagate = _otel()
    context = _context.get_current()
    textmap = propagate.get_global_textmap()
    last = _last
    # Contexts are immutable: the same one through the same propagator gives the same headers.
    if last is not None and last[0] is context and last[1] is textmap:
        return last[2]
    pairs: list[tuple[str, str]] = []
    if trace.get_current_span(context).get_span_context().is_valid:
        carrier: dict[str, str] = {}
        textmap.inject(carrier, context=context)
        pairs = list(carrier.items())
    _last = (context, textmap, pairs)  # one tuple, replaced whole: safe to read from any thread
    return pairs


class _PairsGetter:
    """OpenTelemetry's Getter over (name, value) pairs, names compared without case (Kafka keeps case)."""

    def get(self, carrier: dict[str, str], key: str) -> list[str] | None:
        value = carrier.get(key.lower())
        return None if value is None else [value]

    def keys(self, carrier: dict[str, str]) -> list[str]:
        return list(carrier)


_GETTER = _PairsGetter()


def extract(headers: Iterable[tuple[str, Any]] | None) -> Any:
    """The OpenTelemetry Context carried by these headers (str or bytes values); the first of a repeated
    name wins. An empty Context when they carry none."""
    propagate = _otel()[1]
    carrier: dict[str, str] = {}
    for name, value in headers or ():
        if value is None:
            continue
        lowered = name.lower()
        if lowered not in carrier:
            carrier[lowered] = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return propagate.extract(carrier, getter=_GETTER)
