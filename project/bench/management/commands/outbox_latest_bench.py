"""`manage.py outbox_latest_bench --rows 1000000 --messages 10000 --keys 10000`: time a follow micro-batch's --latest.

A thin wrapper over `project.bench.latest_bench` (also `python -m project.bench.latest_bench`) that takes
Kafka from OUTBOX["base_kafka_config"] and the jars from OUTBOX["spark_jars"]. Figures only;
results are in docs/benchmarks.md.
"""

from __future__ import annotations

import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from outbox import conf
from project.bench import latest_bench as bench


class Command(BaseCommand):
    help = ("Benchmark the audit's follow mode: a micro-batch of new messages on top of a big --latest table, "
            "Parquet's whole-table rewrite beside Delta's MERGE.")
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        bench.add_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        bootstrap = options["bootstrap_servers"] or (conf.setting("base_kafka_config") or {}).get("bootstrap.servers")
        jars = options["jars"] or conf.setting("spark_jars")
        if isinstance(jars, list | tuple):
            jars = ",".join(jars)
        code = bench.run(options["rows"], options["messages"], options["keys"], options["partitions"],
                         bootstrap or "localhost:9092", options["master"], options["rounds"], options["conf"], jars,
                         self.stdout, formats=options["formats"] or bench.FORMATS)
        if code:
            sys.exit(code)
