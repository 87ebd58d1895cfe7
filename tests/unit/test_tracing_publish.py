"""The harvester's tracer without Kafka: a span per batch and topic, its parent or links, what a
single record's span says, failures and holds, and the W3C traceparent parser."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from outbox.harvest.commands import DeliveryError
from outbox.harvest.contract import Record
from outbox.tracing.publish import OtelPublishTracer, parse_traceparent

A = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
B = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Acked:
    def partition(self) -> int:
        return 2

    def offset(self) -> int:
        return 41


@pytest.fixture
def exporter():
    return InMemorySpanExporter()


@pytest.fixture
def tracer(exporter):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return OtelPublishTracer(tracer_provider=provider)


def record(record_id: int, traceparent: str | None = None, topic: str = "orders", waited: float = 2.0) -> Record:
    keys, values = (["traceparent"], [traceparent]) if traceparent else ([], [])
    return Record(record_id, datetime.now(UTC) - timedelta(seconds=waited), topic, f"k{record_id}", "v", keys, values)


def test_a_record_alone_has_its_own_span_with_id_key_partition_and_offset(tracer, exporter):
    [handle] = tracer.sending([record(7, A)])
    assert exporter.get_finished_spans() == ()
    tracer.acknowledged(handle, Acked())
    [span] = exporter.get_finished_spans()
    assert span.name == "send orders" and span.kind is SpanKind.PRODUCER
    assert f"{span.parent.trace_id:032x}" == A.split("-")[1] and f"{span.parent.span_id:016x}" == A.split("-")[2]
    assert span.attributes["messaging.message.id"] == "7" and span.attributes["messaging.kafka.message.key"] == "k7"
    assert span.attributes["messaging.destination.partition.id"] == "2"
    assert span.attributes["messaging.kafka.offset"] == 41
    assert 1.9 < span.attributes["outbox.wait.duration"] < 10


def test_a_batch_is_one_span_per_topic_that_ends_when_every_record_is_settled(tracer, exporter):
    records = [record(1, A), record(2, A), record(3, None, topic="audit"), record(4, A)]
    handles = tracer.sending(records)
    assert handles[0] is handles[1] is handles[3] and handles[2] is not handles[0]
    for handle in handles[:3]:
        tracer.acknowledged(handle, Acked())
    assert [s.name for s in exporter.get_finished_spans()] == ["send audit"], "orders still has a record out"
    tracer.end(handles[3])
    orders = exporter.get_finished_spans()[1]
    assert orders.attributes["messaging.batch.message_count"] == 3
    assert "messaging.message.id" not in orders.attributes and "messaging.kafka.offset" not in orders.attributes
    assert orders.parent is not None and orders.links == (), "one shared context: its child"
    assert exporter.get_finished_spans()[0].parent is None, "no context: a trace of its own"


def test_records_of_several_traces_are_linked_not_parented(tracer, exporter):
    handles = tracer.sending([record(1, A), record(2, B), record(3, A), record(4, "garbage")])
    for handle in handles:
        tracer.end(handle)
    [span] = exporter.get_finished_spans()
    assert span.parent is None
    assert [f"{link.context.span_id:016x}" for link in span.links] == [A.split("-")[2], B.split("-")[2]]


def test_a_traceparent_the_caller_spelt_in_capitals_is_the_records_context(tracer, exporter):
    """stash() keeps a caller's `TraceParent` (header names compared without case) and adds no other: the
    harvester reads it as the record's context, alone or among other traces' records."""
    spelt = Record(5, datetime.now(UTC), "orders", "k5", "v", ["TraceParent", "TraceState"], [B, "vendor=1"])
    tracer.end(tracer.sending([spelt])[0])
    [alone] = exporter.get_finished_spans()
    assert f"{alone.parent.span_id:016x}" == B.split("-")[2] and alone.parent.trace_state.get("vendor") == "1"
    handles = tracer.sending([record(1, A), spelt])
    for handle in handles:
        tracer.end(handle)
    linked = exporter.get_finished_spans()[1]
    assert [f"{link.context.span_id:016x}" for link in linked.links] == [A.split("-")[2], B.split("-")[2]]


def test_a_batch_settled_from_two_threads_at_once_ends_once_after_its_last_record(tracer, exporter):
    handles = tracer.sending([record(i, A) for i in range(1, 20_001)])
    start = threading.Barrier(2)

    def settle(part: list) -> None:  # the delivery thread acknowledges while the engine thread ends
        start.wait()
        for handle in part:
            tracer.acknowledged(handle, Acked())

    threads = [threading.Thread(target=settle, args=(handles[i::2],)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(exporter.get_finished_spans()) == 1


def test_links_stop_at_the_span_link_limit_and_a_context_is_linked_once(tracer, exporter):
    contexts = [f"00-{i:032x}-{i:016x}-01" for i in range(1, 201)]
    handles = tracer.sending([record(i, contexts[i % 200]) for i in range(1, 1001)])
    for handle in handles:
        tracer.end(handle)
    [span] = exporter.get_finished_spans()
    assert len(span.links) == 128 == len({link.context.span_id for link in span.links})


def test_a_failure_and_a_hold_are_recorded_on_the_span_naming_the_record(tracer, exporter):
    handles = tracer.sending([record(1, A), record(2, A)])
    tracer.acknowledged(handles[0], Acked())
    tracer.failed(handles[1], 2, DeliveryError("MSG_SIZE_TOO_LARGE", "too large", permanent=True))
    tracer.held(handles[1], 2, "too large")
    tracer.end(handles[1])
    [span] = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR and span.attributes["error.type"] == "MSG_SIZE_TOO_LARGE"
    assert [(e.name, e.attributes["messaging.message.id"]) for e in span.events] == [("exception", "2"),
                                                                                     ("outbox.hold", "2")]


def test_a_parked_record_gets_a_park_span_in_its_trace(tracer, exporter):
    tracer.parked(record(9, A), "too large", 3, "dead-letters")
    [span] = exporter.get_finished_spans()
    assert span.name == "park orders" and f"{span.parent.span_id:016x}" == A.split("-")[2]
    assert span.attributes["outbox.park.attempts"] == 3
    assert span.attributes["outbox.dead_letter.topic"] == "dead-letters"


@pytest.mark.parametrize("text", ["", "garbage", "00-" + "0" * 32 + "-b7ad6b7169203331-01",
                                  "00-0af7651916cd43dd8448eb211c80319c-" + "0" * 16 + "-01",
                                  "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                                  "00-0af7651916cd43dd8448eb211c80319g-b7ad6b7169203331-01",
                                  A + "-extra"])
def test_malformed_traceparents_are_ignored(text):
    assert parse_traceparent(text) is None


def test_a_traceparent_and_its_tracestate_are_read():
    context = parse_traceparent(A, "vendor=1")
    assert context.is_remote and context.trace_flags.sampled and context.trace_state.get("vendor") == "1"
    later = parse_traceparent("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-future")
    assert later is not None, "a later version's extra fields are allowed"
