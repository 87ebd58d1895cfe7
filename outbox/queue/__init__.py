"""Message queues over Kafka, after kafka-mq-go: many logical queues on one pair of topics.

    from outbox import queue

    queue.send("emails", {"to": "a@example.com"})            # straight to Kafka
    with transaction.atomic():
        order.save()
        queue.stash("emails", {"to": "a@example.com"})       # through the outbox, with the order

    with queue.consumer("emails") as consumer:
        message = consumer.receive(timeout=1.0)
        ...
        message.ack()

Names are loaded on first use, so the engine modules (config, markers, tracker_state, consumer,
tracker, producer) can be imported without Django.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outbox.queue.api import consumer, send, send_many, stash, stash_many
    from outbox.queue.errors import QueueError, Retry
    from outbox.queue.markers_consumer import Message, QueueConsumer

__all__ = ["Message", "QueueConsumer", "QueueError", "Retry", "consumer", "send", "send_many", "stash",
           "stash_many"]

_LAZY = {
    "send": "outbox.queue.api",
    "send_many": "outbox.queue.api",
    "stash": "outbox.queue.api",
    "stash_many": "outbox.queue.api",
    "consumer": "outbox.queue.api",
    "Message": "outbox.queue.markers_consumer",
    "QueueConsumer": "outbox.queue.markers_consumer",
    "QueueError": "outbox.queue.errors",
    "Retry": "outbox.queue.errors",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'outbox.queue' has no attribute {name!r}")
