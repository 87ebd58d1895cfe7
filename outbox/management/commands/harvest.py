"""`manage.py harvest`: publish the outbox to Kafka until SIGTERM or SIGINT.

Run as many replicas as you like against one table; Kafka elects one leader among those that
share a leader topic and group. Settings come from OUTBOX and the environment; flags win.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from outbox import conf, logs
from outbox.embedded import create_harvester
from outbox.gc_tuning import tune_gc
from outbox.harvest.config import Limits, name_problem
from outbox.harvest.harvester import HarvestError
from outbox.harvest.redaction import scrub
from outbox.stopping import on_stop_signals


class Command(BaseCommand):
    help = "Publish outbox records to Kafka, with leader election among replicas, until SIGTERM or SIGINT."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--table", help="outbox table, optionally schema.table (default: OUTBOX['table'])")
        parser.add_argument("--database", help="Django database alias holding the table (default: 'default')")
        parser.add_argument("--leader-topic", help="Kafka topic for leader election (created if missing)")
        parser.add_argument("--leader-group", help="Kafka consumer group for leader election")
        parser.add_argument("--name", help="this replica's name in logs and heartbeats (default: host_pid_time)")
        parser.add_argument("--shards", type=int, metavar="N",
                            help="harvest the table in N shards, each led by one replica of the group (default: "
                                 "OUTBOX['shards'], 1); every replica of a group runs the same N")
        parser.add_argument("--no-listen", dest="listen", action="store_const", const=False,
                            help="do not LISTEN for stash()'s NOTIFY; find new records by polling only")
        parser.add_argument("--metrics-port", type=int, metavar="PORT",
                            help="serve Prometheus metrics on this port (http://0.0.0.0:PORT/metrics)")
        parser.add_argument("--metrics-address", default="0.0.0.0", metavar="ADDRESS",
                            help="address for --metrics-port (default 0.0.0.0)")
        parser.add_argument("--print-config", action="store_true",
                            help="print the effective configuration (secrets redacted) as JSON and exit")
        limits = parser.add_argument_group("limits (see the configuration reference)")
        for spec in dataclasses.fields(Limits):  # one flag per limit: counts take N, durations SECONDS
            counts = spec.type == "int"
            limits.add_argument(f"--{spec.name.replace('_', '-')}", dest=spec.name, type=int if counts else float,
                                metavar="N" if counts else "SECONDS")

    def handle(self, *args: Any, **options: Any) -> None:
        overrides = {name: options.get(name) for name in conf.LIMIT_NAMES}
        overrides.update(table=options["table"], database=options["database"], leader_topic=options["leader_topic"],
                         leader_group=options["leader_group"], name=options["name"], listen=options["listen"],
                         shards=options["shards"])
        if options["database"] is not None and (problem := conf.alias_problem(options["database"])):
            raise CommandError(f"--database: {problem}")
        if options["name"] is not None and (problem := name_problem(options["name"])):
            raise CommandError(f"--name: {problem}")
        try:
            config = conf.harvest_config(**overrides)
        except (TypeError, ValueError) as error:
            raise CommandError(scrub(f"invalid configuration: {error}", conf.secret_values())) from None
        if options["print_config"]:
            # Printed even when invalid (that is when it is wanted), then the problems, and a failure.
            self.stdout.write(json.dumps(config.redacted(), indent=2, default=str))
            problems = conf.problems(**overrides)
            if problems:
                raise CommandError(scrub("invalid configuration: " + "; ".join(map(str, problems)),
                                         conf.secret_values()))
            return
        problems = conf.settings_problems()
        if problems:
            raise CommandError(scrub("invalid OUTBOX setting: " + "; ".join(map(str, problems)), conf.secret_values()))
        logs.configure_logging(options["verbosity"])
        registry = instruments = None
        if options["metrics_port"] is not None:
            try:
                from prometheus_client import CollectorRegistry
            except ImportError:
                raise CommandError("--metrics-port needs prometheus-client: "
                                   "pip install 'django-outbox-harvest[metrics]'") from None

            from outbox.metrics import PrometheusInstruments

            registry = CollectorRegistry()
            instruments = PrometheusInstruments(registry)
        harvester = create_harvester(instruments=instruments, **overrides)
        tune_gc()
        try:
            harvester.start()
        except HarvestError as error:
            raise CommandError(str(error)) from None
        if registry is not None:
            from outbox.metrics import serve

            try:
                serve(harvester, registry, options["metrics_port"], options["metrics_address"])
            except OSError as error:
                harvester.stop()
                harvester.wait()
                raise CommandError(f"cannot serve metrics on port {options['metrics_port']}: {error}") from None
            logging.getLogger("outbox").info("Metrics on http://%s:%d/metrics", options["metrics_address"],
                                             options["metrics_port"])

        with on_stop_signals(harvester.stop):
            try:
                while not harvester.wait(timeout=0.5):
                    pass
            except HarvestError as error:
                raise CommandError(str(error)) from None

