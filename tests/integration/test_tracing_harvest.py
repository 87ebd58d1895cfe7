"""The harvester's spans against real Postgres and Kafka: one per published record, a child of the
trace it was stashed in, with messaging attributes, its wait in the outbox, and its partition and
offset; a failed delivery, a hold and a park are recorded. CloudEvents in binary mode are read back
by the cloudevents SDK's Kafka binding."""

from __future__ import annotations

import time
import uuid
from datetime import datetime

import pytest
from cloudevents.core.bindings.kafka import KafkaMessage, from_binary
from cloudevents.core.formats.json import JSONFormat
from confluent_kafka import Consumer, KafkaError, TopicPartition
from django.db import transaction
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from outbox import stash, stash_many
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.harvester import Harvester
from outbox.models import OutboxRecord
from outbox.tracing.publish import OtelPublishTracer
from tests.support import tracing
from tests.support.harness import SMALL_TOPIC_BYTES, outbox_count, wait_until

# OpenTelemetry's spans: the same on any PostgreSQL server (not in make test-postgres18)
pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True), pytest.mark.postgres_agnostic]





@pytest.fixture
def spans():
    yield tracing.install()
    tracing.uninstall()


def harvester(database_url: str, bootstrap: str, **config: object) -> Harvester:
    leader = f"test-leader-{uuid.uuid4().hex[:8]}"
    instance = Harvester(HarvestConfig(dsn=database_url, base_kafka_config={"bootstrap.servers": bootstrap},
                                       leader_topic=leader, leader_group=leader,
                                       limits=Limits(heartbeat_timeout=2.0), **config),
                         tracer=OtelPublishTracer())
    instance.start()
    return instance


def read_messages(bootstrap: str, topic: str, expected: int, timeout: float = 60) -> list:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"t-{uuid.uuid4().hex}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    found = []
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        deadline = time.monotonic() + timeout
        while len(found) < expected and time.monotonic() < deadline:
            for message in consumer.consume(100, timeout=0.5):
                if message.error() is None:
                    found.append(message)
                elif message.error().code() != KafkaError._PARTITION_EOF:
                    raise AssertionError(f"consumer error: {message.error()}")
    finally:
        consumer.close()
    assert len(found) >= expected, f"waited {timeout}s for {expected} messages on {topic}, got {len(found)}"
    return found


def test_a_record_published_alone_gets_its_own_send_span_in_the_trace_it_was_stashed_in(
        database_url, bootstrap_servers, spans):
    topic = f"traced-{uuid.uuid4().hex[:8]}"
    started = harvester(database_url, bootstrap_servers)
    try:
        with trace.get_tracer("test").start_as_current_span("place order") as request, transaction.atomic():
            record_id = stash(topic, "k1", "v1")
        created = OutboxRecord.objects.get(pk=record_id).create_time
        wait_until(lambda: tracing.named(spans.get_finished_spans(), f"send {topic}"), 30, "the record's send span")
        with transaction.atomic():
            untraced = stash(topic, "k2", "no trace")
        wait_until(lambda: len(tracing.named(spans.get_finished_spans(), f"send {topic}")) == 2, 30,
                   "the untraced record's send span")
    finally:
        started.stop()
        started.wait(timeout=30)
    sends = {s.attributes["messaging.message.id"]: s for s in tracing.named(spans.get_finished_spans(),
                                                                              f"send {topic}")}
    [message, _] = sorted(read_messages(bootstrap_servers, topic, 2), key=lambda m: m.offset())
    span = sends[str(record_id)]
    parent = request.get_span_context()
    assert span.kind is SpanKind.PRODUCER
    assert span.context.trace_id == parent.trace_id and span.parent.span_id == parent.span_id
    attributes = span.attributes
    assert attributes["messaging.system"] == "kafka" and attributes["messaging.operation.type"] == "send"
    assert attributes["messaging.destination.name"] == topic and attributes["messaging.kafka.message.key"] == "k1"
    assert attributes["messaging.destination.partition.id"] == str(message.partition())
    assert attributes["messaging.kafka.offset"] == message.offset()
    assert 0 <= attributes["outbox.wait.duration"] <= span.start_time / 1e9 - created.timestamp() + 0.001
    assert span.status.status_code is StatusCode.UNSET
    # the message carries the stash-time context, unchanged, for its consumers
    assert dict(message.headers())["traceparent"].decode() == tracing.traceparent_of(request)
    assert sends[str(untraced)].parent is None and sends[str(untraced)].links == (), (
        "a record stashed outside any trace starts its own")


def test_a_backlog_is_published_in_batch_spans_with_their_records_contexts(database_url, bootstrap_servers, spans):
    topic = f"traced-{uuid.uuid4().hex[:8]}"
    requests = []
    for name in ("order a", "order b"):
        with trace.get_tracer("test").start_as_current_span(name) as request, transaction.atomic():
            stash_many([{"topic": topic, "key": f"k{n}", "value": f"v{n}"} for n in range(50)])
        requests.append(request.get_span_context())
    started = harvester(database_url, bootstrap_servers)
    try:
        wait_until(lambda: outbox_count(database_url) == 0, 60, "every record published and purged")
    finally:
        started.stop()
        started.wait(timeout=30)
    sends = tracing.named(spans.get_finished_spans(), f"send {topic}")
    counted = sum(s.attributes.get("messaging.batch.message_count", 1) for s in sends)
    assert counted == 100, "every record is in exactly one send span"
    assert len(sends) < 100, "a backlog goes out in batches, a span each"
    expected = {(c.trace_id, c.span_id) for c in requests}
    for span in sends:
        assert span.status.status_code is StatusCode.UNSET
        if span.parent is not None:
            assert (span.parent.trace_id, span.parent.span_id) in expected and span.links == ()
        else:
            assert {(link.context.trace_id, link.context.span_id) for link in span.links} == expected
    assert any(span.parent is None for span in sends) or len({s.parent.span_id for s in sends}) == 2


def test_a_failed_delivery_a_hold_and_a_park_are_recorded(database_url, bootstrap_servers, small_topic,
                                                          spans):
    topic = small_topic
    with trace.get_tracer("test").start_as_current_span("place order") as request, transaction.atomic():
        [good, bad] = stash_many([{"topic": topic, "key": "good", "value": "fine"},
                                  {"topic": topic, "key": "bad", "value": "x" * (2 * SMALL_TOPIC_BYTES)}])
    started = harvester(database_url, bootstrap_servers, park_after=1)
    try:
        wait_until(lambda: outbox_count(database_url) == 0, 60, "the good record published, the bad one parked")
        wait_until(lambda: tracing.named(spans.get_finished_spans(), f"park {topic}"), 10, "the park span")
    finally:
        started.stop()
        started.wait(timeout=30)
    finished = spans.get_finished_spans()
    sends = tracing.named(finished, f"send {topic}")

    def failures_of(span, record_id):
        return [e for e in span.events
                if e.name == "exception" and e.attributes["messaging.message.id"] == str(record_id)]

    bad_sends = [s for s in sends if failures_of(s, bad)]
    assert bad_sends and all(s.status.status_code is StatusCode.ERROR for s in bad_sends)
    assert all(s.attributes["error.type"] == "MSG_SIZE_TOO_LARGE" for s in bad_sends)
    # (the harvester knows the topic's max.message.bytes and holds the record before producing it)
    holds = [e for s in bad_sends for e in s.events if e.name == "outbox.hold"]
    assert len(holds) == 1 and "too large" in holds[0].attributes["outbox.hold.reason"].lower()
    assert holds[0].attributes["messaging.message.id"] == str(bad)
    [park] = tracing.named(finished, f"park {topic}")
    assert park.parent.span_id == request.get_span_context().span_id
    assert park.attributes["outbox.park.attempts"] == 1 and park.status.status_code is StatusCode.ERROR
    # The innocent record went in the same send (its span says two records); nothing failed of it.
    assert all(e.attributes["messaging.message.id"] == str(bad) for s in sends for e in s.events)
    assert sum(s.attributes.get("messaging.batch.message_count", 1) for s in sends) >= 2
    assert good not in {int(s.attributes["messaging.message.id"]) for s in sends if s.attributes.get("error.type")
                        and "messaging.message.id" in s.attributes}


def test_cloudevents_in_binary_mode_are_read_back_by_the_cloudevents_sdk(database_url, bootstrap_servers, spans):
    topic = f"ce-{uuid.uuid4().hex[:8]}"
    with transaction.atomic():
        given = stash(topic, "o-1", {"id": 1, "item": "book"},
                      cloudevent={"type": "com.example.shop.order.placed", "source": "/shop", "subject": "order/1"})
        named = stash(topic, "o-2", {"id": 2}, cloudevent={"type": "com.example.shop.order.placed",
                                                            "source": "/shop", "id": "order-2-placed"})
    created = {row.id: row.create_time for row in OutboxRecord.objects.all()}
    started = harvester(database_url, bootstrap_servers)
    try:
        wait_until(lambda: outbox_count(database_url) == 0, 60, "both records published")
    finally:
        started.stop()
        started.wait(timeout=30)
    events = {}
    for message in read_messages(bootstrap_servers, topic, 2):
        kafka_message = KafkaMessage(headers={k: v for k, v in message.headers()}, key=message.key(),
                                     value=message.value())
        events[int(dict(message.headers())["outbox-id"])] = from_binary(kafka_message, JSONFormat())
    first, second = events[given], events[named]
    assert first.get_id() == str(given), "ce_id is the outbox id unless one was given"
    assert second.get_id() == "order-2-placed"
    assert first.get_source() == "/shop" and first.get_type() == "com.example.shop.order.placed"
    assert first.get_specversion() == "1.0" and first.get_subject() == "order/1"
    assert first.get_datacontenttype() == "application/json"
    assert first.get_data() == {"id": 1, "item": "book"}
    assert isinstance(first.get_time(), datetime) and first.get_time() == created[given]
