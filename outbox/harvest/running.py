"""Running a harvester as a process until SIGTERM or SIGINT: what `manage.py harvest` and the stand-alone
`outbox-harvest` share, so the two entry points differ only in where their configuration comes from.

Every failure is a RunFailure whose text is one line for the operator; each entry point shows it its own way
(Django's CommandError, or `outbox-harvest: ...` and exit status 1).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from argparse import ArgumentParser
from collections.abc import Callable, Mapping
from typing import Any

from outbox import logs
from outbox.gc_tuning import tune_gc
from outbox.harvest import events
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.discovery import DISCOVER_INTERVAL
from outbox.harvest.harvester import Harvester, HarvestError
from outbox.harvest.instruments import Instruments
from outbox.harvest.outboxes import ManyHarvester
from outbox.harvest.shards import ShardedHarvester
from outbox.harvest.tracing import PublishTracer
from outbox.kafka.problems import Problem
from outbox.metrics_endpoint import EndpointFailure
from outbox.reasons import first_line
from outbox.stopping import on_stop_signals

log = logging.getLogger("outbox")

AnyHarvester = Harvester | ShardedHarvester | ManyHarvester


class RunFailure(Exception):
    """The harvester cannot run, or stopped on an error: one line."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one harvester process runs, as its entry point built it from its settings (OUTBOX and flags for
    `manage.py harvest`, a TOML file, the environment and flags for `outbox-harvest`): from here on the two run
    the same way (harvest())."""

    config: HarvestConfig
    #: The limits the user set (a problem of a limit derived from one of them is said once, on that one).
    given_limits: set[str]
    #: Everything wrong, the engine's config's problems included.
    problems: list[Problem]
    #: The process runs several outboxes (OUTBOX["outboxes"], the file's [outboxes], --outbox, --tenant-schemas).
    several: bool = False
    #: With several: the supervisor's discover() (None when the outboxes' entries themselves are wrong).
    discover: Callable[[], dict[str, HarvestConfig]] | None = None
    discover_interval: float = DISCOVER_INTERVAL

    def warnings(self) -> list[Problem]:
        """What to log at start, besides the problems (none: `manage.py check` said them before the command)."""
        return []


def harvest(plan: Plan, *, print_config: bool, out: Callable[[str], None], verbosity: int = 1,
            metrics_port: int | None = None, metrics_address: str = "",
            readers: Callable[[], dict[str, Callable[[], Any]]] | None = None,
            sink: Callable[[Harvester, events.Event], None] | None = None, tracer: PublishTracer | None = None) -> None:
    """Print the configuration (to `out`; invalid is when it is wanted, so it is printed, then refused), or run the
    plan until a stop signal: RunFailure (one line) when it cannot. `readers` makes the metrics' database readers,
    `sink` and `tracer` go to every engine."""
    if print_config:
        printed, problems = _printed(plan)
        out(printed)
        if problems:
            raise RunFailure("invalid configuration: " + "; ".join(problems))
        return
    if plan.problems:
        raise RunFailure("invalid configuration: " + "; ".join(map(str, plan.problems)))
    logs.configure_logging(verbosity)
    for warning in plan.warnings():
        log.warning("%s (outbox.%s)", warning, warning.code)
    registry, instruments = metrics_registry(metrics_port)
    harvester: AnyHarvester
    if plan.discover is None:
        harvester = engine_for(plan.config, sink, tracer, instruments)
    else:
        harvester = ManyHarvester(plan.discover, name=plan.config.name, rescan_interval=plan.discover_interval,
                                  on_event=sink, tracer=tracer,
                                  instruments=None if instruments is None else lambda _label: instruments)
    run_until_stopped(harvester, registry, metrics_address, metrics_port,
                      readers() if registry is not None and readers is not None else None)


def _printed(plan: Plan) -> tuple[str, list[str]]:
    """--print-config: the configuration (secrets redacted) as JSON, and what is wrong with it. With several
    outboxes, each one's as discovered now, by label, with its problems naming its label; a problem of the base
    configuration is said once more, unlabelled, unless every outbox's repeats it (an entry may override the key)."""
    if not plan.several:
        return json.dumps(plan.config.redacted(), indent=2, default=str), list(map(str, plan.problems))
    if plan.discover is None:  # something besides the engines' configuration is wrong: nothing is discovered
        raise RunFailure("invalid configuration: " + "; ".join(map(str, plan.problems)))
    try:
        found = plan.discover()
    except Exception as error:
        raise RunFailure(f"cannot find the outboxes: {first_line(error)}") from None
    each = {label: config.validate(given_limits=plan.given_limits) for label, config in sorted(found.items())}
    printed = json.dumps({label: config.redacted() for label, config in sorted(found.items())}, indent=2, default=str)
    return printed, [*(str(p) for p in plan.problems if not each or any(p not in own for own in each.values())),
                     *(f"{label}: {problem}" for label, own in each.items() for problem in own)]


def discoverable(config: HarvestConfig, given_limits: set[str], problems: list[Problem], print_config: bool) -> bool:
    """Whether several outboxes are to be discovered: when nothing is wrong, or, to print them, when every problem
    is the base configuration's own (each outbox's configuration then says whether it repeats it)."""
    base = config.validate(given_limits=given_limits)
    return not problems or (print_config and all(problem in base for problem in problems))


#: The engine's keys a flag sets, by the key's name, in manage.py harvest and outbox-harvest alike (flags win).
SETTING_FLAGS = ("table", "leader_topic", "leader_group", "name", "shards", "listen")


def add_setting_flags(parser: ArgumentParser) -> None:
    """The flags of SETTING_FLAGS, as both ways of running the harvester take them."""
    parser.add_argument("--table", help="outbox table, optionally schema.table (default: the settings', else outbox)")
    parser.add_argument("--leader-topic", help="Kafka topic for leader election, created if missing (default: "
                                               "derived from the database and table)")
    parser.add_argument("--leader-group", help="Kafka consumer group for leader election (default: the topic's "
                                               "derived name, also where --leader-topic is given)")
    parser.add_argument("--name", help="this replica's name in logs, heartbeats and status rows (default: "
                                       "host_pid_time)")
    parser.add_argument("--shards", type=int, metavar="N", help="harvest the table in N shards, each led by one "
                                                                "replica of the group (default: the settings', else "
                                                                "1); every replica of a group runs the same N")
    parser.add_argument("--no-listen", dest="listen", action="store_const", const=False,
                        help="do not LISTEN for the table's NOTIFY; find new records by polling only")


def add_outbox_flags(parser: ArgumentParser, where: str, table: str) -> None:
    """The flags that pick several outboxes for one process: of `where` (the setting or file section listing
    them), and `table` (where the table is set, else) in every tenant schema."""
    parser.add_argument("--outbox", action="append", metavar="NAME",
                        help=f"harvest this outbox of {where} (repeat for several; default: all of them, when "
                             f"{where} is set)")
    parser.add_argument("--tenant-schemas", action="store_true",
                        help=f"harvest the table (--table, else {table}) in every schema that has one, "
                             "django-tenants style; a schema created while running is picked up")
    parser.add_argument("--exclude-schema", action="append", metavar="SCHEMA",
                        help="with --tenant-schemas: leave this schema out (repeat for several)")


def outbox_flags_problem(options: Mapping[str, Any], where: str, *, several: bool) -> str | None:
    """Why the flags cannot go together, in one line naming the flag, or None. `several`: the process runs several
    outboxes (--outbox, --tenant-schemas, or `where` lists them), each deriving its own leader topic and group."""
    tenants = options.get("tenant_schemas")
    rules = [
        (options.get("exclude_schema") and not tenants, "--exclude-schema: applies only with --tenant-schemas"),
        *((several and options.get(flag) is not None,
           f"--{flag.replace('_', '-')}: cannot be given with several outboxes; each derives its own (or set it in its "
           f"{where} entry)") for flag in ("leader_topic", "leader_group")),
        *((several and options.get(flag) is not None and not tenants,
           f"--{flag}: with {where}, each outbox names its own (--{flag} goes with --tenant-schemas)")
          for flag in ("table", "database")),
    ]
    return next((why for broken, why in rules if broken), None)


def add_limit_flags(parser: ArgumentParser) -> None:
    """One flag per limit (counts take N, durations SECONDS), named as the setting is."""
    limits = parser.add_argument_group("limits (see the configuration reference)")
    for spec in dataclasses.fields(Limits):
        counts = spec.type == "int"
        limits.add_argument(f"--{spec.name.replace('_', '-')}", dest=spec.name, type=int if counts else float,
                            metavar="N" if counts else "SECONDS", help=spec.metadata["doc"].split(". ")[0])


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


def engine_for(config: HarvestConfig, sink: Callable[[Harvester, events.Event], None] | None = None,
               tracer: PublishTracer | None = None,
               instruments: Instruments | None = None) -> Harvester | ShardedHarvester:
    """The engine for one outbox: a ShardedHarvester (an engine per shard it leads, each the sender of its
    events) when `config` has shards, else a Harvester. One set of instruments for the replica: its engines'
    marks and purges add up in the same metrics."""
    if config.shards > 1:
        return ShardedHarvester(config, on_event=sink, tracer=tracer,
                                instruments=None if instruments is None else lambda _shard: instruments)
    return Harvester.sending_events_to(sink, config, instruments=instruments, tracer=tracer)


def run_until_stopped(harvester: AnyHarvester, registry: Any = None, metrics_address: str = "",
                      metrics_port: int | None = None, readers: dict[str, Callable[[], Any]] | None = None) -> None:
    """Start (RunFailure with the reason if it cannot), serve `registry` and the harvester's gauges (read with
    the entry point's `readers`) on the metrics port, harvest until a stop signal, and return once everything
    in flight has settled (RunFailure if the harvester failed meanwhile)."""
    tune_gc()
    try:
        harvester.start()
    except HarvestError as error:
        raise RunFailure(str(error)) from None
    if registry is not None:
        from outbox.metrics import serve

        try:
            port = serve(harvester, registry, metrics_port, metrics_address, **(readers or {}))
        except EndpointFailure as error:
            harvester.stop()
            harvester.wait()
            raise RunFailure(str(error)) from None
        log.info("Metrics on http://%s:%s/metrics", metrics_address, port)
    with on_stop_signals(harvester.stop):
        try:
            while not harvester.wait(timeout=0.5):
                pass
        except HarvestError as error:
            raise RunFailure(str(error)) from None
