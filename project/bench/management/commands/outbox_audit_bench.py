"""`manage.py outbox_audit_bench --messages 5000000 --keys 10000`: publish, audit, print figures.

A thin wrapper over `project.bench.audit_bench` (also `python -m project.bench.audit_bench`) that takes
Kafka from OUTBOX["base_kafka_config"] and the jars from OUTBOX["spark_jars"]. Figures only;
results are in docs/benchmarks.md.
"""

from __future__ import annotations

import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from outbox import conf
from project.bench import audit_bench as bench


class Command(BaseCommand):
    help = "Benchmark the Spark audit: produce harvested-format messages to a new topic, audit it, print records/s."
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        bench.add_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        bootstrap = options["bootstrap_servers"] or (conf.setting("base_kafka_config") or {}).get("bootstrap.servers")
        jars = options["jars"] or conf.setting("spark_jars")
        if isinstance(jars, list | tuple):
            jars = ",".join(jars)
        code = bench.run(options["messages"], options["keys"], options["partitions"], bootstrap or "localhost:9092",
                         options["master"], options["value_bytes"], options["conf"], options["keep_topic"], jars,
                         self.stdout, topic=options["topic"], sink_format=options["sink_format"])
        if code:
            sys.exit(code)
