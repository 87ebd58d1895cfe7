"""Running a harvester as a process until SIGTERM or SIGINT: what `manage.py harvest` and the stand-alone
`outbox-harvest` share, so the two entry points differ only in where their configuration comes from.

Every failure is a RunFailure whose text is one line for the operator; each entry point shows it its own way
(Django's CommandError, or `outbox-harvest: ...` and exit status 1).
"""

from __future__ import annotations

import dataclasses
import logging
from argparse import ArgumentParser
from collections.abc import Callable
from typing import Any

from outbox.gc_tuning import tune_gc
from outbox.harvest.config import Limits
from outbox.harvest.harvester import Harvester, HarvestError
from outbox.harvest.outboxes import ManyHarvester
from outbox.harvest.shards import ShardedHarvester
from outbox.stopping import on_stop_signals

log = logging.getLogger("outbox")

AnyHarvester = Harvester | ShardedHarvester | ManyHarvester
LIMIT_FLAGS = tuple(spec.name for spec in dataclasses.fields(Limits))


class RunFailure(Exception):
    """The harvester cannot run, or stopped on an error: one line."""


def add_limit_flags(parser: ArgumentParser) -> None:
    """One flag per limit (counts take N, durations SECONDS), named as the setting is."""
    limits = parser.add_argument_group("limits (see the configuration reference)")
    for spec in dataclasses.fields(Limits):
        counts = spec.type == "int"
        limits.add_argument(f"--{spec.name.replace('_', '-')}", dest=spec.name, type=int if counts else float,
                            metavar="N" if counts else "SECONDS", help=spec.metadata["doc"].split(". ")[0])


def add_metrics_flags(parser: ArgumentParser) -> None:
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve Prometheus metrics on this port (http://0.0.0.0:PORT/metrics)")
    parser.add_argument("--metrics-address", default="0.0.0.0", metavar="ADDRESS",
                        help="address for --metrics-port (default 0.0.0.0)")


def metrics_registry(port: int | None) -> tuple[Any, Any]:
    """With a metrics port: a Prometheus registry and the engine's instruments in it; else (None, None)."""
    if port is None:
        return None, None
    try:
        from prometheus_client import CollectorRegistry
    except ImportError:
        raise RunFailure("--metrics-port needs prometheus-client: pip install 'django-outbox-harvest[metrics]'") \
            from None
    from outbox.metrics import PrometheusInstruments

    registry = CollectorRegistry()
    return registry, PrometheusInstruments(registry)


def run_until_stopped(harvester: AnyHarvester, serve_metrics: Callable[[], None] | None = None,
                      metrics_address: str = "", metrics_port: int | None = None) -> None:
    """Start (RunFailure with the reason if it cannot), serve the metrics, harvest until a stop signal, and
    return once everything in flight has settled (RunFailure if the harvester failed meanwhile)."""
    tune_gc()
    try:
        harvester.start()
    except HarvestError as error:
        raise RunFailure(str(error)) from None
    if serve_metrics is not None:
        try:
            serve_metrics()
        except OSError as error:
            harvester.stop()
            harvester.wait()
            raise RunFailure(f"cannot serve metrics on port {metrics_port}: {error}") from None
        log.info("Metrics on http://%s:%s/metrics", metrics_address, metrics_port)
    with on_stop_signals(harvester.stop):
        try:
            while not harvester.wait(timeout=0.5):
                pass
        except HarvestError as error:
            raise RunFailure(str(error)) from None
