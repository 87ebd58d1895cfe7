"""Run a harvester inside another Django process (a web worker, a Celery worker...).

    from outbox import create_harvester
    harvester = create_harvester()
    harvester.start()
    ...
    harvester.stop(); harvester.wait()
"""

from __future__ import annotations

from typing import Any

from outbox import conf, signals
from outbox.harvest.harvester import Harvester
from outbox.harvest.instruments import Instruments
from outbox.harvest.running import engine_for
from outbox.harvest.shards import ShardedHarvester
from outbox.harvest.tracing import PublishTracer
from outbox.tracing.switch import tracing_on


def create_harvester(*, instruments: Instruments | None = None, tracer: PublishTracer | None = None,
                     **overrides: Any) -> Harvester | ShardedHarvester:
    """A Harvester configured from settings.OUTBOX (plus overrides) whose events become Django signals;
    with OUTBOX["shards"] (or the override) above 1, a ShardedHarvester (an engine per shard it leads,
    each the sender of its signals).

    With tracing on (OUTBOX["tracing"] and opentelemetry-api installed) and no `tracer` given, each
    published record gets a span from OpenTelemetry's global tracer provider (docs/tracing.md).
    """
    return engine_for(conf.harvest_config(**overrides), signals.send_event,
                      tracer if tracer is not None else default_tracer(), instruments)


def default_tracer() -> PublishTracer | None:
    """A span for each published record from OpenTelemetry's global tracer provider, when tracing is on (OUTBOX's
    `tracing` and opentelemetry-api installed); else None."""
    if not tracing_on():
        return None
    from outbox.tracing.publish import OtelPublishTracer

    return OtelPublishTracer()
