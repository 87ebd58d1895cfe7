"""Trace context at write time: stash(), stash_many(), queue.stash() and queue.send() add the current
span's W3C context (never over the caller's headers); nothing is added with tracing off, and nothing
of OpenTelemetry is imported then."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.db import transaction
from django.test import override_settings
from opentelemetry import baggage, context, trace

from outbox import queue, stash, stash_many
from outbox.models import OutboxRecord
from tests.support import tracing

# OpenTelemetry's spans: the same on any PostgreSQL server (not in make test-postgres18)
pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True), pytest.mark.postgres_agnostic]


@pytest.fixture
def spans():
    yield tracing.install()
    tracing.uninstall()


def headers_of(record_id: int) -> list[tuple[str, str]]:
    row = OutboxRecord.objects.get(pk=record_id)
    return list(zip(row.kafka_header_keys, row.kafka_header_values, strict=True))


def test_stash_adds_the_current_spans_traceparent(spans):
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("place order") as span, transaction.atomic():
        record_id = stash("orders", "1", {"id": 1}, headers={"app": "shop"})
    headers = dict(headers_of(record_id))
    assert headers["app"] == "shop"
    assert headers["traceparent"] == tracing.traceparent_of(span)
    assert next(iter(headers)) == "app", "the caller's headers come first, as given"


def test_nothing_is_added_without_a_current_span(spans):
    with transaction.atomic():
        record_id = stash("orders", "1", "v")
    assert headers_of(record_id) == []


def test_the_callers_traceparent_is_never_overwritten(spans):
    theirs = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with trace.get_tracer("test").start_as_current_span("place order"), transaction.atomic():
        record_id = stash("orders", "1", "v", headers=[("traceparent", theirs)])
    assert headers_of(record_id) == [("traceparent", theirs)]


def test_baggage_travels_when_the_propagator_carries_it(spans):
    token = context.attach(baggage.set_baggage("tenant", "acme"))
    try:
        with trace.get_tracer("test").start_as_current_span("place order"), transaction.atomic():
            record_id = stash("orders", "1", "v")
    finally:
        context.detach(token)
    assert dict(headers_of(record_id))["baggage"] == "tenant=acme"


def test_stash_many_adds_the_context_to_every_record(spans):
    with trace.get_tracer("test").start_as_current_span("import") as span, transaction.atomic():
        ids = stash_many([{"topic": "orders", "key": str(n), "value": "v"} for n in range(3)])
    assert {dict(headers_of(i))["traceparent"] for i in ids} == {tracing.traceparent_of(span)}


def test_queue_stash_carries_the_context(spans):
    with trace.get_tracer("test").start_as_current_span("place order") as span, transaction.atomic():
        queue.stash("order-confirmations", {"order": 1})
    [row] = OutboxRecord.objects.all()
    headers = dict(zip(row.kafka_header_keys, row.kafka_header_values, strict=True))
    assert headers["traceparent"] == tracing.traceparent_of(span) and "mq-id" in headers


@override_settings(OUTBOX={"tracing": False})
def test_tracing_off_adds_nothing(spans):
    with trace.get_tracer("test").start_as_current_span("place order"), transaction.atomic():
        record_id = stash("orders", "1", "v")
    assert headers_of(record_id) == []


def test_tracing_off_imports_nothing_of_opentelemetry(database_url):
    """In a fresh process with OUTBOX["tracing"] False, a stash() leaves opentelemetry unimported."""
    code = """
import os, sys, django
os.environ["DJANGO_SETTINGS_MODULE"] = "project.settings"
from django.conf import settings
django.setup()
settings.OUTBOX = {**settings.OUTBOX, "tracing": False}
from django.db import transaction
from outbox import stash
with transaction.atomic():
    stash("orders", "1", "v")
    transaction.set_rollback(True)
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "DATABASE_URL": database_url})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_each_span_propagates_its_own_context_and_nested_spans_theirs(spans):
    tracer = trace.get_tracer("test")
    found = []
    with tracer.start_as_current_span("first") as first, transaction.atomic():
        found.append((stash("orders", "1", "v"), first))
        with tracer.start_as_current_span("inner") as inner:
            found.append((stash("orders", "2", "v"), inner))
        found.append((stash("orders", "3", "v"), first))
    with tracer.start_as_current_span("second") as second, transaction.atomic():
        found.append((stash("orders", "4", "v"), second))
    for record_id, span in found:
        assert dict(headers_of(record_id))["traceparent"] == tracing.traceparent_of(span)
