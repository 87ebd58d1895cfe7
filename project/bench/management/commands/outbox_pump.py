"""`manage.py outbox_pump`: fill the outbox with keyed records, at full speed or a steady rate.

Like goharvest's pump: load for benchmarks and soak tests.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections, transaction

from outbox.stasher import stash_many
from project.bench.writer import PLAIN_INSERT  # what a writer in another language does: no stash(), no NOTIFY


def pump(*, records: int, keys: int, topic: str, rate: float | None = None, batch: int = 1000, value_bytes: int = 100,
         database: str = "default", on_commit: Any = None, writer: str = "stash",
         stop: threading.Event | None = None) -> int:
    """Write `records` records over `keys` keys in transactions of `batch`; returns how many were written.

    `writer` is "stash" (stash_many()) or "sql" (plain INSERT statements, as an application in any
    language would write them). With `rate` (records/s), transactions are paced to that rate;
    `on_commit(ids, commit_time)` is called after each commit (the latency benchmark records
    commit times with it). Once `stop` is set, no further transaction begins (a soak that is
    interrupted ends its writers at once, not when their records would have run out).
    """
    padding = "x" * max(0, value_bytes - 20)
    written = 0
    began = time.perf_counter()
    stop = stop or threading.Event()
    while written < records and not stop.is_set():
        count = min(batch, records - written)
        rows = [{"topic": topic, "key": f"key-{(written + i) % keys}", "value": f"{written + i}:{padding}"}
                for i in range(count)]
        with transaction.atomic(using=database):
            if writer == "sql":
                ids = []
                with connections[database].cursor() as cursor:
                    for row in rows:
                        cursor.execute(PLAIN_INSERT, [row["topic"], row["key"], row["value"]])
                        ids.append(cursor.fetchone()[0])
            else:
                ids = stash_many(rows, using=database)
        if on_commit is not None:
            on_commit(ids, time.time())
        written += count
        if rate:
            ahead = written / rate - (time.perf_counter() - began)
            if ahead > 0:
                stop.wait(ahead)
    connections[database].close()
    return written


class Command(BaseCommand):
    help = "Fill the outbox with keyed records, for load tests and benchmarks."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--records", type=int, required=True, help="how many records to write")
        parser.add_argument("--keys", type=int, default=1000, help="distinct keys, round-robin (default 1000)")
        parser.add_argument("--rate", type=float, help="records per second (default: as fast as possible)")
        parser.add_argument("--topic", default="outbox-pump", help="Kafka topic of the records (default outbox-pump)")
        parser.add_argument("--batch", type=int, default=1000, help="records per transaction (default 1000)")
        parser.add_argument("--value-bytes", type=int, default=100, help="approximate value size (default 100)")
        parser.add_argument("--database", default="default")
        parser.add_argument("--writer", choices=["stash", "sql"], default="stash",
                            help="stash_many(), or plain INSERT statements (default stash)")

    def handle(self, *args: Any, **options: Any) -> None:
        for name in ("records", "keys", "batch"):
            if options[name] < 1:
                raise CommandError(f"--{name} must be at least 1, got {options[name]}")
        if options["rate"] is not None and options["rate"] <= 0:
            raise CommandError(f"--rate must be positive, got {options['rate']}")
        began = time.perf_counter()
        written = pump(records=options["records"], keys=options["keys"], topic=options["topic"], rate=options["rate"],
                       batch=options["batch"], value_bytes=options["value_bytes"], database=options["database"],
                       writer=options["writer"])
        elapsed = time.perf_counter() - began
        self.stdout.write(f"pumped {written} records over {options['keys']} keys into topic {options['topic']!r} "
                          f"in {elapsed:.1f}s ({written / elapsed:,.0f} records/s)")
