"""The queue's side of tracing from Django settings: a consumer's tracer, and trace context on send()."""

from __future__ import annotations

from typing import Any

from outbox.queue.config import QueueConfig
from outbox.tracing.switch import tracing_on


def consumer_tracer(config: QueueConfig, queue: str) -> Any:
    """A QueueTracer for a consumer of `queue` when tracing is on (OUTBOX["tracing"]), else None."""
    if not tracing_on():
        return None
    from outbox.tracing.consume import QueueTracer

    return QueueTracer(queue, config.topic, config.consumer_group(queue))
