"""The queue's side of tracing from Django settings: a consumer's tracer, and trace context on send()."""

from __future__ import annotations

from typing import Any

from outbox.queue.config import QueueConfig
from outbox.tracing.switch import tracing_on


def consumer_tracer(config: QueueConfig, queue: str, *, share: bool = False) -> Any:
    """A QueueTracer for a consumer of `queue` (on the share backend: its topic and share group) when tracing is
    on (OUTBOX["tracing"]), else None."""
    if not tracing_on():
        return None
    from outbox.tracing.consume import QueueTracer

    if share:
        return QueueTracer(queue, config.share_topic(queue), config.share_group(queue))
    return QueueTracer(queue, config.topic, config.consumer_group(queue))
