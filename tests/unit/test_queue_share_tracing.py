"""The share backend's spans without Kafka (a fake client): the handler's span is a child of the message's
trace context with the broker's delivery count, and a redelivery links to the earlier deliveries this process
traced (the only ones it can know: Kafka keeps nothing per delivery of a share group's record)."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from outbox.queue.config import QueueConfig, QueueLimits
from outbox.queue.delivery_spans import SeenDeliveries
from outbox.queue.share_consumer import ShareQueueConsumer
from outbox.tracing.consume import QueueTracer
from tests.unit.test_queue_share_state import FakeRecord, FakeShareConsumer

SENDER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
CONFIG = QueueConfig(limits=QueueLimits(redelivery_timeout=10.0, max_deliveries=5, backend="share"))


class TracedRecord(FakeRecord):
    """A record whose sender was in a span: its traceparent travels in the headers."""

    def headers(self) -> list[tuple[str, bytes]]:
        return [*super().headers(), ("traceparent", SENDER.encode())]


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def traced(fake: FakeShareConsumer, exporter: InMemorySpanExporter) -> ShareQueueConsumer:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = QueueTracer("q", CONFIG.share_topic("q"), CONFIG.share_group("q"), tracer_provider=provider)
    consumer = ShareQueueConsumer(CONFIG, "q", dead_letters=lambda letters: None, consumer_factory=lambda c: fake,
                                  tracer=tracer)
    consumer._consumer = fake  # as open() leaves it, without Kafka
    return consumer


def handle_next(consumer: ShareQueueConsumer, settle: Any) -> Any:
    consumer.round()  # polls
    message = consumer.receive(timeout=0)
    assert message is not None and message.span is not None
    settle(message)
    consumer.round()  # sends the acknowledgement
    return message


def test_the_handlers_span_is_a_child_of_the_messages_context_with_the_delivery_count(exporter):
    consumer = traced(FakeShareConsumer([[TracedRecord(5, 1)]]), exporter)
    handle_next(consumer, lambda message: message.ack())
    [span] = exporter.get_finished_spans()
    assert span.name == "process q" and span.kind is SpanKind.CONSUMER
    assert f"{span.parent.trace_id:032x}" == SENDER.split("-")[1] and f"{span.parent.span_id:016x}" == (
        SENDER.split("-")[2])
    attributes = span.attributes
    assert attributes["outbox.queue.deliveries"] == 1 and attributes["outbox.queue.outcome"] == "acked"
    assert attributes["messaging.destination.name"] == CONFIG.share_topic("q")
    assert attributes["messaging.consumer.group.name"] == CONFIG.share_group("q")
    assert attributes["messaging.message.id"] == "id5" and attributes["messaging.kafka.offset"] == 5
    assert span.links == ()


def test_a_redelivery_is_a_new_span_linked_to_the_deliveries_this_process_traced(exporter):
    # The broker hands the same record back with its delivery count up; the third delivery went elsewhere.
    fake = FakeShareConsumer([[TracedRecord(5, 1)], [TracedRecord(5, 2)], [TracedRecord(5, 4)]])
    consumer = traced(fake, exporter)
    handle_next(consumer, lambda message: message.retry())
    handle_next(consumer, lambda message: message.abandon())
    handle_next(consumer, lambda message: message.ack())
    first, second, fourth = exporter.get_finished_spans()
    assert [s.attributes["outbox.queue.deliveries"] for s in (first, second, fourth)] == [1, 2, 4]
    assert [s.attributes["outbox.queue.outcome"] for s in (first, second, fourth)] == ["retried", "abandoned", "acked"]
    assert {s.parent.span_id for s in (first, second, fourth)} == {int(SENDER.split("-")[2], 16)}
    assert [(link.context.span_id, link.attributes["outbox.queue.delivery"]) for link in fourth.links] == [
        (first.context.span_id, 1), (second.context.span_id, 2)], "no link to the delivery this process never saw"
    assert [link.context.span_id for link in second.links] == [first.context.span_id]


def test_a_message_received_but_never_settled_ends_its_span_at_close(exporter):
    consumer = traced(FakeShareConsumer([[TracedRecord(5, 1)]]), exporter)
    consumer.round()
    assert consumer.receive(timeout=0) is not None
    consumer.close(timeout=0)
    [span] = exporter.get_finished_spans()
    assert span.attributes["outbox.queue.outcome"] == "unsettled"


def test_without_a_tracer_there_are_no_spans():
    fake = FakeShareConsumer([[TracedRecord(5, 1)]])
    consumer = ShareQueueConsumer(CONFIG, "q", dead_letters=lambda letters: None, consumer_factory=lambda c: fake)
    consumer._consumer = fake
    consumer.round()
    assert consumer.receive(timeout=0).span is None


def test_the_deliveries_seen_are_kept_for_the_newest_messages_only():
    seen = SeenDeliveries(size=2)
    for delivery in range(1, 20):
        seen.add("a", delivery, f"tp-a-{delivery}")
    seen.add("b", 1, "tp-b")
    seen.add("c", 1, "tp-c")
    assert seen.earlier("a") == [], "the oldest message is forgotten"
    assert seen.earlier("c") == [(1, "tp-c")]
    seen.add("b", 2, "tp-b2")
    assert seen.earlier("b") == [(1, "tp-b"), (2, "tp-b2")]
    many = SeenDeliveries()
    for delivery in range(1, 20):
        many.add("a", delivery, f"tp-{delivery}")
    assert [number for number, _ in many.earlier("a")] == list(range(4, 20)), "the newest 16 deliveries"


def test_a_markers_redelivery_numbers_its_links_back_from_itself_when_the_header_kept_only_the_newest():
    """mq-trace-links keeps the newest MAX_TRACE_LINKS deliveries' traceparents: the 20th delivery's links are
    deliveries 4 to 19, not 1 to 16."""
    from outbox.queue import markers
    from outbox.queue.consumer_state import Delivery
    from outbox.queue.delivery_spans import DeliverySpans

    class Recording:
        earlier: list[tuple[int, str]] = []

        def started(self, ref: Any, message_id: str, deliveries: int, headers: Any, earlier: Any) -> object:
            Recording.earlier = earlier
            return object()

        def traceparent(self, span: Any) -> str:
            return ""

    kept = [f"00-{n:032x}-{n:016x}-01" for n in range(4, 4 + markers.MAX_TRACE_LINKS)]
    headers = [(markers.TRACE_LINKS_HEADER, ",".join(kept).encode())]
    delivery = Delivery(ref=(0, 1), id="m", key=None, payload=b"", raw_headers=headers, deliveries=20,
                        received_at=0.0, last_marker=0.0)
    DeliverySpans(Recording()).start(delivery, markers.Marker(markers.Kind.START, (0, 1)))
    assert [number for number, _ in Recording.earlier] == list(range(4, 20))
    assert Recording.earlier[0][1] == kept[0]


def test_a_span_that_cannot_start_does_not_keep_a_taken_message_from_its_handler(exporter, caplog):
    # The delivery is taken when receive() finds it: a surprise from tracing must not strand it (the batch would
    # never be settled, and the consumer would poll no more).
    consumer = traced(FakeShareConsumer([[TracedRecord(5, 1)]]), exporter)

    def broken(delivery: Any) -> None:
        raise RuntimeError("span processor failed")

    consumer.spans.received = broken  # type: ignore[method-assign]
    message = handle_next_untraced(consumer)
    assert message.id == "id5" and "span processor failed" in caplog.text


def handle_next_untraced(consumer: ShareQueueConsumer) -> Any:
    consumer.round()
    message = consumer.receive(timeout=0)
    assert message is not None
    message.ack()
    consumer.round()
    return message
