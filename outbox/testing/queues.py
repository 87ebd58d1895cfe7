"""Queues in your own tests, with no Kafka: the messages `queue.send()` would have published, and a handler run
on a message as `manage.py outbox_consume` runs it (the same outbox.queue.handling, the inbox included).

    from outbox.testing import capture_sent, handle_message

    def test_signing_up_sends_the_welcome_email(db):
        with capture_sent("emails") as sent:
            sign_up("a@example.com")
        assert sent[0].json() == {"to": "a@example.com"}

    def test_the_handler_acks_and_writes_once(db):
        first = handle_message(send_welcome_email, {"to": "a@example.com"}, queue="emails", inbox=True)
        again = handle_message(send_welcome_email, {"to": "a@example.com"}, queue="emails", inbox=True,
                               message_id=first.message.id, deliveries=2)
        assert (first.outcome, again.outcome) == ("handled", "skipped")

Messages `queue.stash()` writes go through the outbox: `capture_stashed()` and `harvest()` see them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

__all__ = ["Handled", "SentMessage", "capture_sent", "handle_message"]


@dataclass(frozen=True)
class SentMessage:
    """One message `queue.send()` (or `send_many()`) would have published."""

    queue: str
    id: str
    payload: bytes
    headers: list[tuple[str, str]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.payload.decode()

    def json(self) -> Any:
        return json.loads(self.payload)


@dataclass(frozen=True)
class Handled:
    """What running a handler on a message came to."""

    #: "handled", "skipped" (the inbox had it: acked without running the handler), "retried" or "failed".
    outcome: str
    #: How the message was settled: "acked", "retried" (redelivered after `retry_delay`) or "abandoned"
    #: (redelivered after the redelivery timeout).
    settled: str
    retry_delay: float | None
    message: Any


class _Recorder:
    """Stands in for the queue's producer: records what send() hands it."""

    def __init__(self, sent: list[SentMessage], queue: str | None) -> None:
        self._sent, self._queue = sent, queue

    def send(self, queue: str, messages: Sequence[tuple[bytes, Sequence[tuple[str, bytes]]]], *,
             key: bytes | None = None, ids: Sequence[str] | None = None) -> list[str]:
        ids = list(ids) if ids is not None else [uuid.uuid4().hex for _ in messages]
        if self._queue is None or queue == self._queue:
            self._sent.extend(SentMessage(queue, message_id, payload, [(k, v.decode()) for k, v in headers])
                              for message_id, (payload, headers) in zip(ids, messages, strict=True))
        return ids


@contextmanager
def capture_sent(queue: str | None = None) -> Iterator[list[SentMessage]]:
    """Inside the block, `queue.send()` and `send_many()` validate their messages as always and record them here
    instead of publishing them (only those of `queue`, if given); the list holds them in order."""
    from outbox.queue import api

    sent: list[SentMessage] = []
    recorder = _Recorder(sent, queue)
    with mock.patch.object(api, "_producer", lambda config: recorder), \
            mock.patch.object(api, "_ensure_share_topic", lambda config, queue: None):
        yield sent


class _Settlements:
    """Stands in for the consumer a Message is settled through: it records how."""

    def __init__(self, queue: str) -> None:
        from outbox.queue.delivery_spans import NoSpans

        self.queue = queue
        self.spans = NoSpans()
        self.settled: tuple[str, float | None] | None = None

    def _settle(self, message: Any, kind: Any, delay: float = 0.0) -> None:
        from outbox.queue.markers import Kind

        if self.settled is None:
            self.settled = ("acked", None) if kind is Kind.END else ("retried", delay) if kind is Kind.KEEPALIVE \
                else ("abandoned", None)

    def _after_failure(self, message: Any) -> tuple[str, bool]:
        return "abandoned (outbox_consume would have it redelivered)", True


def handle_message(handler: Callable[[Any], Any], payload: Any, *, queue: str,
                   headers: Mapping[str, str] | Sequence[tuple[str, str]] | None = None, deliveries: int = 1,
                   message_id: str | None = None, inbox: bool = False, using: str = "default") -> Handled:
    """Run `handler` on a message of `queue` carrying `payload` (encoded as send() encodes it: JSON for a dict or
    list), as `manage.py outbox_consume` would: with `inbox`, in a transaction with the message's inbox row on
    database `using` (a message whose row is there is acked without running the handler)."""
    from outbox.queue import api, app_settings, handling, markers
    from outbox.queue.consumer_state import Delivery
    from outbox.queue.markers_consumer import Message
    from outbox.queue.runner import DatabaseInbox

    row = api._clean(app_settings.queue_config(), payload, headers, "payload")
    message_id = message_id or uuid.uuid4().hex
    raw = markers.message_headers(list(zip(row.header_keys, (v.encode() for v in row.header_values), strict=True)),
                                  message_id=message_id, deliveries=deliveries)
    settlements = _Settlements(queue)
    delivery = Delivery((0, 0), message_id, queue.encode(), row.value.encode(), raw, deliveries, 0.0, 0.0)
    message = Message(settlements, delivery)  # type: ignore[arg-type]  # the consumer's settling, recorded
    outcome = handling.handle(message, handler, DatabaseInbox(using) if inbox else None)
    settled, delay = settlements.settled or ("unsettled", None)
    return Handled(outcome.value, settled, delay, message)
