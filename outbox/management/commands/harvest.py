"""`manage.py harvest`: publish the outbox to Kafka until SIGTERM or SIGINT.

Run as many replicas as you like against one table; Kafka elects one leader among those that
share a leader topic and group. Settings come from OUTBOX and the environment; flags win.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from outbox import conf, logs, many, settings_problems
from outbox.embedded import create_harvester, create_many_harvester
from outbox.harvest import running
from outbox.kafka.names import name_problem
from outbox.kafka.redaction import scrub


def refused(what: str, problems: list[Any]) -> CommandError:
    """One line: what failed and every problem, secrets masked."""
    return CommandError(scrub(f"{what}: " + "; ".join(map(str, problems)), conf.secret_values()))


class Command(BaseCommand):
    help = "Publish outbox records to Kafka, with leader election among replicas, until SIGTERM or SIGINT."

    def add_arguments(self, parser: CommandParser) -> None:
        running.add_setting_flags(parser)
        parser.add_argument("--database", help="Django database alias holding the table (default: 'default')")
        running.add_outbox_flags(parser, many.OUTBOXES, "OUTBOX['table']")
        running.add_metrics_flags(parser)
        parser.add_argument("--print-config", action="store_true",
                            help="print the effective configuration (secrets redacted) as JSON and exit")
        running.add_limit_flags(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        overrides = {name: options[name] for name in ("database", *running.SETTING_FLAGS, *conf.LIMIT_NAMES)}
        if options["database"] is not None and (problem := conf.alias_problem(options["database"])):
            raise CommandError(f"--database: {problem}")
        if options["name"] is not None and (problem := name_problem(options["name"])):
            raise CommandError(f"--name: {problem}")
        several = bool(options["outbox"] or options["tenant_schemas"] or many.configured())
        if problem := running.outbox_flags_problem(options, many.OUTBOXES, several=several):
            raise CommandError(problem)
        if not options["print_config"]:  # which prints first, then the problems
            if problems := settings_problems.settings_problems():
                raise refused("invalid OUTBOX setting", problems)
            if problems := settings_problems.problems(**overrides):  # a flag's once, on the flag the user gave
                raise refused("invalid configuration", problems)
        if several:
            self._harvest_many(options, overrides)
            return
        try:
            config = conf.harvest_config(**overrides)
        except (TypeError, ValueError) as error:
            raise refused("invalid configuration", [error]) from None
        if options["print_config"]:
            # Printed even when invalid (that is when it is wanted), then the problems, and a failure.
            self.stdout.write(json.dumps(config.redacted(), indent=2, default=str))
            if problems := settings_problems.problems(**overrides):
                raise refused("invalid configuration", problems)
            return
        logs.configure_logging(options["verbosity"])
        registry, instruments = self._metrics_registry(options)
        harvester = create_harvester(instruments=instruments, **overrides)
        self._start_and_run(harvester, registry, options)

    def _harvest_many(self, options: dict[str, Any], overrides: dict[str, Any]) -> None:
        """Several outboxes in this process (outbox/many.py, outbox/harvest/outboxes.py)."""
        registry, instruments = self._metrics_registry(options)
        try:
            harvester = create_many_harvester(options["outbox"], tenant_schemas=options["tenant_schemas"],
                                              exclude_schemas=options["exclude_schema"], instruments=instruments,
                                              **overrides)
        except (TypeError, ValueError) as error:
            raise refused("invalid configuration", [error]) from None
        if options["print_config"]:  # each outbox found now, by label
            try:
                found = harvester.discover()
            except Exception as error:
                raise refused("cannot find the outboxes", [error]) from None
            printed, problems = running.outboxes_printed(found, conf.build(**overrides)[1])
            self.stdout.write(printed)
            if problems := [*settings_problems.settings_problems(), *problems]:
                raise refused("invalid configuration", problems)
            return
        logs.configure_logging(options["verbosity"])
        self._start_and_run(harvester, registry, options)

    def _start_and_run(self, harvester: Any, registry: Any, options: dict[str, Any]) -> None:
        """Start (a one-line error if it cannot), serve the metrics, run until a stop signal."""
        readers = None
        if registry is not None:
            from outbox.metrics_readers import READERS

            readers = READERS
        try:
            running.run_until_stopped(harvester, registry, options["metrics_address"], options["metrics_port"],
                                      readers)
        except running.RunFailure as error:
            raise CommandError(str(error)) from None

    def _metrics_registry(self, options: dict[str, Any]) -> tuple[Any, Any]:
        """With --metrics-port: a Prometheus registry and the engine's instruments in it; else (None, None)."""
        try:
            return running.metrics_registry(options["metrics_port"])
        except running.RunFailure as error:
            raise CommandError(str(error)) from None
