"""The queue consumer continues the trace: the handler runs in a span whose parent is the message's
trace context; a redelivery is a new span linked to the earlier ones with its delivery count. And
the example shop's order, traced from its view through the outbox to the queue handler. The share backend's
span likewise, with the broker's delivery count, and nothing of OpenTelemetry imported with tracing off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.db import transaction
from django.test import Client
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from outbox import stash
from outbox.models import OutboxRecord
from outbox.queue import api, app_settings
from outbox.queue.errors import Retry
from outbox.queue.runner import HandlerRunner
from outbox.queue.topics import ensure_topics
from outbox.tracing.publish import OtelPublishTracer
from project.shop.handlers import confirm_order
from project.shop.models import Order
from tests.support import tracing
from tests.support.harness import wait_until
from tests.support.queue_harness import (
    new_prefix,
    queue_settings,
    running_harvester,
    running_tracker,
    share_groups_missing,
)

# OpenTelemetry's spans: the same on any PostgreSQL server (not in make test-postgres18)
pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True), pytest.mark.postgres_agnostic]


@pytest.fixture
def config(settings, bootstrap_servers):
    """OUTBOX["queues"] on a fresh topic pair, created before anyone uses it."""
    settings.OUTBOX = {**settings.OUTBOX, "queues": queue_settings(new_prefix())}
    ensure_topics(app_settings.queue_config(), 10)
    return app_settings.queue_config()


def ended(tracker, queue: str, count: int) -> bool:
    """The tracker read `count` End markers of `queue` and holds nothing of it in progress."""
    view = tracker.snapshot
    return view.ends.get(queue, 0) >= count and queue not in view.queues


@pytest.fixture
def spans():
    yield tracing.install()
    tracing.uninstall()


def run_handler(consumer, handler, until, what: str, **options) -> None:
    runner = HandlerRunner(consumer, handler, **options)
    runner.start()
    try:
        wait_until(until, 60, what)
    finally:
        runner.stop()
        runner.join()


def test_the_handler_runs_in_a_span_whose_parent_is_the_senders(config, spans):
    with trace.get_tracer("test").start_as_current_span("sign up") as sender:
        message_id = api.send("welcome", {"user": 7})
    inside = []

    def handler(message):
        inside.append(trace.get_current_span().get_span_context())
        with transaction.atomic():  # work the handler does joins the trace: a stash() carries its span
            stash("audit", "7", "welcomed")

    with api.consumer("welcome") as consumer:
        run_handler(consumer, handler, lambda: consumer.acked == 1, "the message handled and acked")
    [process] = tracing.named(spans.get_finished_spans(), "process welcome")
    assert process.kind is SpanKind.CONSUMER
    assert process.parent.span_id == sender.get_span_context().span_id
    assert process.context.trace_id == sender.get_span_context().trace_id
    assert inside == [process.context], "the handler ran with the delivery's span current"
    attributes = process.attributes
    assert attributes["messaging.system"] == "kafka" and attributes["messaging.operation.type"] == "process"
    assert attributes["messaging.message.id"] == message_id and attributes["outbox.queue.deliveries"] == 1
    assert attributes["messaging.destination.name"] == config.topic
    assert attributes["outbox.queue.outcome"] == "acked" and process.links == ()
    [row] = OutboxRecord.objects.filter(kafka_topic="audit")
    assert dict(zip(row.kafka_header_keys, row.kafka_header_values, strict=True))["traceparent"] == (
        tracing.traceparent_of(process))


def test_a_redelivery_is_a_new_span_linked_to_the_earlier_ones(config, spans):
    with trace.get_tracer("test").start_as_current_span("sign up") as sender:
        api.send("flaky", {"user": 8})

    def handler(message):
        if message.deliveries < 3:
            raise Retry("not yet") if message.deliveries == 1 else RuntimeError("boom")

    with running_tracker(config) as tracker, api.consumer("flaky", redelivery_timeout=2.0) as consumer:
        run_handler(consumer, handler, lambda: consumer.acked == 1, "the third delivery acked")
        wait_until(lambda: ended(tracker, "flaky", 3), 30, "the tracker to end the three deliveries")
    processes = sorted(tracing.named(spans.get_finished_spans(), "process flaky"),
                       key=lambda s: s.attributes["outbox.queue.deliveries"])
    assert [s.attributes["outbox.queue.deliveries"] for s in processes] == [1, 2, 3]
    assert {s.parent.span_id for s in processes} == {sender.get_span_context().span_id}
    first, second, third = processes

    def ids(contexts):
        return [(c.trace_id, c.span_id) for c in contexts]

    assert first.links == () and ids(link.context for link in second.links) == ids([first.context])
    assert ids(link.context for link in third.links) == ids([first.context, second.context])
    assert [link.attributes["outbox.queue.delivery"] for link in third.links] == [1, 2]
    assert [s.attributes["outbox.queue.outcome"] for s in processes] == ["retried", "abandoned", "acked"]
    assert second.status.status_code is StatusCode.ERROR and any(e.name == "exception" for e in second.events)
    assert first.status.status_code is StatusCode.UNSET, "a Retry is not an error"


def test_one_trace_covers_the_order_view_the_outbox_wait_the_publish_and_the_queue_handler(
        config, database_url, bootstrap_servers, spans, capsys):
    response = Client(HTTP_HOST="127.0.0.1").post("/", {"item": "kettle", "quantity": 1})
    assert response.status_code == 302
    order = Order.objects.get(item="kettle")
    [view] = tracing.named(spans.get_finished_spans(), "POST /")
    with running_harvester(database_url, bootstrap_servers, tracer=OtelPublishTracer()), \
            api.consumer("order-confirmations") as consumer:
        run_handler(consumer, confirm_order, lambda: Order.objects.get(pk=order.pk).confirmed,
                    "the order to be confirmed", inbox=True)
    finished = spans.get_finished_spans()
    trace_id = view.context.trace_id
    in_trace = [s for s in finished if s.context.trace_id == trace_id]
    by_name = {s.name: s for s in in_trace}
    assert {"POST /", "send orders", f"send {config.topic}", "process order-confirmations"} <= set(by_name)
    for name in ("send orders", f"send {config.topic}", "process order-confirmations"):
        assert by_name[name].parent.span_id == view.context.span_id, f"{name} is a child of the order view"
    assert by_name["send orders"].attributes["outbox.wait.duration"] >= 0
    assert by_name["process order-confirmations"].start_time >= by_name[f"send {config.topic}"].start_time
    with capsys.disabled():
        print("\n" + tracing.render(finished, trace_id))


@pytest.fixture
def share_config(settings, bootstrap_servers):
    """OUTBOX["queues"] on fresh topics, every queue on the share backend; skipped without share groups."""
    reason = share_groups_missing(bootstrap_servers)
    if reason is not None:
        pytest.skip(f"the broker at {bootstrap_servers} has no share groups (needs Apache Kafka 4.2+): {reason}")
    settings.OUTBOX = {**settings.OUTBOX, "queues": queue_settings(new_prefix(), backend="share",
                                                                   redelivery_timeout=3.0, max_deliveries=3)}
    return app_settings.queue_config()


def test_a_share_queues_handler_runs_in_the_senders_trace_and_a_redelivery_shows_its_delivery_count(
        share_config, spans):
    """The share backend: the same span as the markers backend's, with the broker's delivery count; the
    redelivery, to the same process here, links to the first delivery's span."""
    with trace.get_tracer("test").start_as_current_span("sign up") as sender:
        message_id = api.send("welcome", {"user": 9})
    inside = []

    def handler(message):
        inside.append((message.deliveries, trace.get_current_span().get_span_context()))
        if message.deliveries == 1:
            raise Retry("not yet")

    with api.consumer("welcome") as consumer:
        run_handler(consumer, handler, lambda: consumer.acked == 1, "the redelivered message acked")
    processes = sorted(tracing.named(spans.get_finished_spans(), "process welcome"),
                       key=lambda s: s.attributes["outbox.queue.deliveries"])
    assert [s.attributes["outbox.queue.deliveries"] for s in processes] == [1, 2], "the broker's delivery count"
    first, second = processes
    assert {s.parent.span_id for s in processes} == {sender.get_span_context().span_id}
    assert {s.context.trace_id for s in processes} == {sender.get_span_context().trace_id}
    assert inside == [(1, first.context), (2, second.context)], "the handler ran with the delivery's span current"
    assert [s.attributes["outbox.queue.outcome"] for s in processes] == ["retried", "acked"]
    assert first.links == () and [(link.context.span_id, link.attributes["outbox.queue.delivery"])
                                  for link in second.links] == [(first.context.span_id, 1)]
    for span in processes:
        assert span.kind is SpanKind.CONSUMER and span.attributes["messaging.message.id"] == message_id
        assert span.attributes["messaging.destination.name"] == share_config.share_topic("welcome")
        assert span.attributes["messaging.consumer.group.name"] == share_config.share_group("welcome")


def test_a_share_consumer_with_tracing_off_imports_nothing_of_opentelemetry(share_config, database_url,
                                                                          bootstrap_servers):
    """In a fresh process with OUTBOX["tracing"] False, a share queue's message sent, received and acked leaves
    opentelemetry unimported, and the message has no span."""
    code = """
import os, sys, django
os.environ["DJANGO_SETTINGS_MODULE"] = "project.settings"
from django.conf import settings
django.setup()
settings.OUTBOX = {**settings.OUTBOX, "tracing": False}
from outbox.queue import api
api.send("quiet", "x")
with api.consumer("quiet") as consumer:
    message = None
    while message is None:
        message = consumer.receive(timeout=1)
    message.ack()
print(message.span, sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""
    env = {**os.environ, "DATABASE_URL": database_url, "KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers,
           "OUTBOX_QUEUE_PREFIX": share_config.topic, "OUTBOX_QUEUE_BACKEND": "share"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "None []"
