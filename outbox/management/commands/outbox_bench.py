"""Benchmarks that print figures (never assert them). `manage.py outbox_bench stash --rows 100000`."""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import connections, transaction
from django.test import override_settings

from outbox import conf
from outbox.models import OutboxRecord
from outbox.stasher import stash, stash_many

BENCH_TOPIC = "outbox-bench"


class Command(BaseCommand):
    help = "Measure the outbox: `stash` writes rows with stash() and stash_many() and prints rows/s."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="mode", required=True)
        stash_parser = sub.add_parser("stash", help="rows/s for stash() in a loop and stash_many() in batches")
        stash_parser.add_argument("--rows", type=int, default=100_000)
        stash_parser.add_argument("--batch", type=int, default=1000, help="rows per transaction (default 1000)")
        stash_parser.add_argument("--value-bytes", type=int, default=100)
        stash_parser.add_argument("--database", default="default")

    def handle(self, *args: Any, mode: str, **options: Any) -> None:
        getattr(self, f"bench_{mode}")(**options)

    def bench_stash(self, rows: int, batch: int, value_bytes: int, database: str, **_: Any) -> None:
        """Rows are committed (commit cost counts), then deleted; a running harvester may publish some."""
        value = "v" * value_bytes
        headers = [("source", "bench")]
        self.stdout.write(f"stash benchmark: {rows} rows of {value_bytes}-byte values, {batch} rows a transaction, "
                          f"database {database!r}")
        for notify in (True, False):
            with override_settings(OUTBOX={**conf.raw_settings(), "notify": notify}):
                for name, write in (("stash() loop", self._loop), ("stash_many()", self._many)):
                    elapsed = 0.0
                    for start in range(0, rows, batch):
                        count = min(batch, rows - start)
                        records = [{"topic": BENCH_TOPIC, "key": f"k{(start + i) % 1000}", "value": value,
                                    "headers": headers} for i in range(count)]
                        began = time.perf_counter()
                        with transaction.atomic(using=database):
                            write(records, database)
                        elapsed += time.perf_counter() - began
                    OutboxRecord.objects.using(database).filter(kafka_topic=BENCH_TOPIC).delete()
                    self.stdout.write(f"  {name:<14} notify={'on ' if notify else 'off'}  "
                                      f"{rows / elapsed:>10,.0f} rows/s  ({elapsed:.2f} s)")
        connections[database].close()

    @staticmethod
    def _loop(records: list[dict[str, Any]], database: str) -> None:
        for record in records:
            stash(**record, using=database)

    @staticmethod
    def _many(records: list[dict[str, Any]], database: str) -> None:
        stash_many(records, using=database)
