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
from outbox.harvest.tracing import PublishTracer
from outbox.tracing.switch import tracing_on


def create_harvester(*, instruments: Instruments | None = None, tracer: PublishTracer | None = None,
                     **overrides: Any) -> Harvester:
    """A Harvester configured from settings.OUTBOX (plus overrides) whose events become Django signals.

    With tracing on (OUTBOX["tracing"] and opentelemetry-api installed) and no `tracer` given, each
    published record gets a span from OpenTelemetry's global tracer provider (docs/tracing.md).
    """
    holder: list[Harvester] = []
    if tracer is None and tracing_on():
        from outbox.tracing.publish import OtelPublishTracer

        tracer = OtelPublishTracer()
    harvester = Harvester(conf.harvest_config(**overrides), instruments=instruments,
                          on_event=lambda event: signals.send_event(holder[0], event), tracer=tracer)
    holder.append(harvester)
    return harvester
