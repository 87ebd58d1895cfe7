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
from outbox.harvest.outboxes import ManyHarvester
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
    if tracer is None and tracing_on():
        from outbox.tracing.publish import OtelPublishTracer

        tracer = OtelPublishTracer()
    return engine_for(conf.harvest_config(**overrides), signals.send_event, tracer, instruments)


def create_many_harvester(names: list[str] | None = None, *, tenant_schemas: bool = False,
                          exclude_schemas: list[str] | None = None, instruments: Instruments | None = None,
                          tracer: PublishTracer | None = None, **overrides: Any) -> ManyHarvester:
    """A ManyHarvester over the outboxes of OUTBOX["outboxes"] (those in `names`, else all) and, with
    `tenant_schemas`, the table (overrides' `table`, else OUTBOX's) of every schema that has one
    (outbox/many.py); each engine the sender of its signals. Raises ValueError naming a bad entry."""
    from outbox import many

    if tracer is None and tracing_on():
        from outbox.tracing.publish import OtelPublishTracer

        tracer = OtelPublishTracer()
    entries = many.selected_entries(names, tenant_schemas=tenant_schemas, table=overrides.get("table"),
                                    database=overrides.get("database"), exclude_schemas=exclude_schemas)
    base = conf.harvest_config(**overrides)
    discover = many.discoverer(base, entries, conf.given_limits(**overrides))
    return ManyHarvester(discover, name=base.name, rescan_interval=conf.setting("discover_interval"),
                         on_event=signals.send_event, tracer=tracer,
                         instruments=(lambda _label: instruments) if instruments is not None else None)
