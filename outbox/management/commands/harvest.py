"""`manage.py harvest`: publish the outbox to Kafka until SIGTERM or SIGINT.

Run as many replicas as you like against one table; Kafka elects one leader among those that
share a leader topic and group. Settings come from OUTBOX and the environment; flags win. What runs, and how, is
the stand-alone `outbox-harvest`'s (harvest/running.py): this command only builds its plan from settings.OUTBOX.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from outbox import conf, many, settings_problems, signals
from outbox.embedded import default_tracer
from outbox.harvest import running
from outbox.kafka.names import name_problem
from outbox.kafka.redaction import scrub
from outbox.metrics_endpoint import add_metrics_flags


class Command(BaseCommand):
    help = "Publish outbox records to Kafka, with leader election among replicas, until SIGTERM or SIGINT."

    def add_arguments(self, parser: CommandParser) -> None:
        running.add_setting_flags(parser)
        parser.add_argument("--database", help="Django database alias holding the table (default: 'default')")
        running.add_outbox_flags(parser, many.OUTBOXES, "OUTBOX['table']")
        add_metrics_flags(parser)
        parser.add_argument("--print-config", action="store_true",
                            help="print the effective configuration (secrets redacted) as JSON and exit")
        running.add_limit_flags(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            running.harvest(plan(options), print_config=options["print_config"], out=self.stdout.write,
                            verbosity=options["verbosity"], metrics_port=options["metrics_port"],
                            metrics_address=options["metrics_address"], readers=_readers, sink=signals.send_event,
                            tracer=default_tracer())
        except running.RunFailure as error:
            raise CommandError(scrub(str(error), conf.secret_values())) from None


def plan(options: dict[str, Any]) -> running.Plan:
    """OUTBOX, the environment and the flags (which win) to what the process runs; RunFailure (one line) for a flag
    that cannot be, an `--outbox` OUTBOX["outboxes"] does not have, or, unless the configuration is to be printed, a
    bad OUTBOX setting."""
    overrides = {name: options[name] for name in ("database", *running.SETTING_FLAGS, *conf.LIMIT_NAMES)}
    for flag, problem_of in (("database", conf.alias_problem), ("name", name_problem)):
        if options[flag] is not None and (problem := problem_of(options[flag])):
            raise running.RunFailure(f"--{flag}: {problem}")
    several = bool(options["outbox"] or options["tenant_schemas"] or many.configured())
    if problem := running.outbox_flags_problem(options, many.OUTBOXES, several=several):
        raise running.RunFailure(problem)
    if not options["print_config"] and (found := settings_problems.settings_problems()):
        raise running.RunFailure("invalid OUTBOX setting: " + "; ".join(map(str, found)))
    problems = settings_problems.problems(**overrides)  # a flag's once, on the flag the user gave
    config, given, _ = conf.build(**overrides)
    discover = None
    if several and running.discoverable(config, given, problems, options["print_config"]):
        try:
            entries = many.selected_entries(options["outbox"], tenant_schemas=options["tenant_schemas"],
                                            table=options["table"], database=options["database"],
                                            exclude_schemas=options["exclude_schema"])
        except ValueError as error:
            raise running.RunFailure(f"invalid configuration: {error}") from None
        discover = many.discoverer(config, entries, given)
    return running.Plan(config, given, problems, several, discover, conf.setting("discover_interval"))


def _readers() -> dict[str, Any]:
    from outbox.metrics_readers import READERS  # Django's reads of the database, at scrape time

    return READERS
