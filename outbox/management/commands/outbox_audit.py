"""`manage.py outbox_audit --topics T1,T2 --out DIR`: audit what the harvester published.

A thin wrapper over `outbox.pipeline.cli` (which runs without Django, e.g. under spark-submit):
it only adds defaults from settings. Kafka comes from OUTBOX["base_kafka_config"] (its bootstrap
servers, and its security settings, translated for Spark's Kafka source), the jars
from OUTBOX["spark_jars"], and `--ledger-table` without `--ledger-url` reads the table from the
outbox's own database. Exit status: 0 clean, 1 reversals or missing ids, 2 bad arguments or
unreachable Kafka, 3 Spark failed. See docs/audit.md. Without pyspark (the `spark` extra) every
use, `--help` included, is one line saying what to install, and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import connections

from outbox import conf
from outbox.pipeline import cli

PROG = "outbox_audit"


class Command(BaseCommand):
    help = "Audit and de-duplicate Kafka topics written by the harvester, with Spark (see docs/audit.md)."
    requires_system_checks: list[str] = []  # a read-only audit; don't fail on unrelated settings

    def run_from_argv(self, argv: list[str]) -> None:
        missing = cli.pyspark_missing()
        if missing:
            self.stderr.write(f"{PROG}: error: {missing}\n")
            sys.exit(2)
        super().run_from_argv(argv)

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)

        def one_line_error(message: str) -> None:
            self.stderr.write(f"{PROG}: error: {message} (see --help)\n")
            sys.exit(2)

        parser.error = one_line_error  # type: ignore[method-assign]
        return parser

    def add_arguments(self, parser: CommandParser) -> None:
        cli.add_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        namespace = argparse.Namespace(**options)
        self.stderr.style_func = None  # progress lines are not errors: no red in a terminal
        code = cli.run(namespace, defaults=self._defaults(), stdout=self.stdout, stderr=self.stderr, prog=PROG)
        if code:
            sys.exit(code)

    @staticmethod
    def _defaults() -> cli.Defaults:
        base = conf.kafka_config()  # bootstrap.servers: OUTBOX's, else KAFKA_BOOTSTRAP_SERVERS, as harvest's
        database = connections[conf.setting("database")].settings_dict
        host = database.get("HOST") or "localhost"
        port = database.get("PORT") or 5432
        url = f"jdbc:postgresql://{host}:{port}/{database.get('NAME') or ''}"
        properties = {key: str(database[name]) for key, name in (("user", "USER"), ("password", "PASSWORD"))
                      if database.get(name)}
        return cli.Defaults(bootstrap_servers=base["bootstrap.servers"], spark_jars=conf.setting("spark_jars"),
                            ledger_url=url, ledger_properties=properties, kafka_config=dict(base))
