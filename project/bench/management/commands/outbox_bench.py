"""Benchmarks that print figures (never assert them).

    manage.py outbox_bench stash   --rows 100000
    manage.py outbox_bench drain   --records 1000000 --keys 10000 --keys 10
    manage.py outbox_bench latency --rate 2000 --duration 30
    manage.py outbox_bench dbcost  --records 200000 --rate 2000 --duration 30 [--writer stash]
    manage.py outbox_bench soak    --minutes 60 --rate 2000 --hold-transaction 20:10
    manage.py outbox_bench compare --reaper PATH          # goharvest's reaper, drains
    manage.py outbox_bench compare --peer debezium        # Debezium: drain, steady, unrelated writes

`drain` and `latency` run the real `manage.py harvest` in a subprocess against the outbox of
database `default` and the project's Kafka, and sample its memory with psutil. They need an
empty outbox and no other harvester running on it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import psycopg
from confluent_kafka import Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections, transaction
from django.test import override_settings

from outbox import conf
from outbox.harvest.contract import HeldRecord, ReplicaState
from outbox.harvest.status import StatusSnapshot
from outbox.harvest.status_board import BoardReporter, StatusBoards
from outbox.harvest.store import APPLICATION_PREFIX
from outbox.models import HarvesterSample, HarvesterStatus, OutboxRecord
from outbox.stasher import stash, stash_many
from project.bench import dbcost, soak, tracing_bench
from project.bench.management.commands.outbox_pump import pump

BENCH_TOPIC = "outbox-bench"


class Command(BaseCommand):
    help = "Measure the outbox: stash() rows/s, harvester drain throughput, commit-to-ack latency, peak RSS."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="mode", required=True)
        stash_parser = sub.add_parser("stash", help="rows/s for stash() in a loop and stash_many() in batches")
        stash_parser.add_argument("--rows", type=int, default=100_000)
        stash_parser.add_argument("--batch", type=int, default=1000, help="rows per transaction (default 1000)")
        stash_parser.add_argument("--value-bytes", type=int, default=100)
        stash_parser.add_argument("--database", default="default")

        drain = sub.add_parser("drain", help="records/s draining a backlog, from first mark to last purge")
        drain.add_argument("--records", type=int, default=1_000_000)
        drain.add_argument("--keys", type=int, action="append", help="distinct keys (repeat for several runs; "
                                                                      "default 10000 and 10)")
        drain.add_argument("--partitions", type=int, default=8, help="partitions of the benchmark topic")
        drain.add_argument("--max-message-bytes", type=int, metavar="BYTES",
                           help="the benchmark topic's max.message.bytes (default: the broker's)")
        drain.add_argument("--replicas", type=int, default=1,
                           help="harvester processes in one group (default 1; with --harvest-arg=--shards=N they "
                                "share the shards)")
        drain.add_argument("--harvest-arg", action="append", default=[], dest="harvest_args",
                           help="extra flag for manage.py harvest, e.g. --harvest-arg=--mark-query-records=500")
        drain.add_argument("--standalone", action="store_true",
                           help="run the stand-alone harvester (python -m outbox.harvest) instead of manage.py harvest")

        latency = sub.add_parser("latency", help="commit-to-ack latency percentiles at a steady offered rate")
        latency.add_argument("--rate", type=float, default=2000.0, help="records/s offered (default 2000)")
        latency.add_argument("--duration", type=float, default=30.0, help="seconds of load (default 30)")
        latency.add_argument("--keys", type=int, default=1000)
        latency.add_argument("--batch", type=int, default=20, help="records per transaction (default 20)")
        latency.add_argument("--partitions", type=int, default=8)
        latency.add_argument("--writer", choices=["stash", "sql"], default="stash",
                             help="stash_many(), or plain INSERT statements woken only by the table's trigger")
        latency.add_argument("--harvest-arg", action="append", default=[], dest="harvest_args")
        latency.add_argument("--standalone", action="store_true",
                             help="run the stand-alone harvester (python -m outbox.harvest) instead of manage.py "
                                  "harvest")

        dbcost = sub.add_parser("dbcost", help="what harvesting costs Postgres (CPU, WAL, statements) beside what "
                                               "writing the same records cost, in a drain and at a steady rate")
        dbcost.add_argument("--records", type=int, default=200_000, help="backlog of the drain (0: no drain)")
        dbcost.add_argument("--keys", type=int, default=1000)
        dbcost.add_argument("--rate", type=float, action="append", help="records/s of a steady phase (repeatable; "
                                                                        "default 2000 and 10000; 0: none)")
        dbcost.add_argument("--duration", type=float, default=30.0, help="seconds of each steady phase")
        dbcost.add_argument("--batch", type=int, default=None, help="records per writer transaction (default: "
                                                                    "rate / 100, at least 1)")
        dbcost.add_argument("--partitions", type=int, default=8)
        dbcost.add_argument("--writer", choices=["sql", "stash"], default="sql",
                            help="steady writers: one INSERT a row (sql), or stash_many(), one INSERT a transaction")
        dbcost.add_argument("--harvest-arg", action="append", default=[], dest="harvest_args")

        soak_parser = sub.add_parser("soak", help="writers at a steady rate for a long while; a line of figures "
                                                  "every minute and a verdict (project/bench/soak.py)")
        soak_parser.add_argument("--minutes", type=float, default=60.0)
        soak_parser.add_argument("--rate", type=float, default=2000.0, help="records/s, half plain SQL, half stash")
        soak_parser.add_argument("--keys", type=int, default=200)
        soak_parser.add_argument("--warmup", type=float, default=30.0,
                                 help="seconds of writing before the first minute, said apart and left out of the "
                                      "minutes and the verdict (default 30: a broker's JVM warms up)")
        soak_parser.add_argument("--harvesters", type=int, default=1, help="harvester processes (default 1)")
        soak_parser.add_argument("--partitions", type=int, default=8)
        soak_parser.add_argument("--hold-transaction", metavar="START:MINUTES",
                                 help="hold a REPEATABLE READ transaction open from minute START for MINUTES")
        soak_parser.add_argument("--harvest-arg", action="append", default=[], dest="harvest_args")

        compare = sub.add_parser("compare", help="this harvester beside a peer on the same workloads: goharvest's "
                                                 "reaper (drains), or Debezium (drain, steady rates, unrelated "
                                                 "writes; what each costs Postgres), with the ratios")
        compare.add_argument("--peer", choices=["goharvest", "debezium"], default="goharvest")
        compare.add_argument("--reaper", help="goharvest: path to its reaper binary (built elsewhere)")
        compare.add_argument("--backlog", action="append", metavar="RECORDS:KEYS",
                             help="goharvest: repeatable (default 1000000:10000, 60000:10, 20000:1)")
        compare.add_argument("--partitions", type=int, default=8)
        compare.add_argument("--harvest-arg", action="append", default=[], dest="harvest_args")
        compare.add_argument("--rounds", type=int, default=2, help="debezium: rounds, alternating which relay goes "
                                                                   "first (default 2)")
        compare.add_argument("--records", type=int, default=200_000, help="debezium: the drain's backlog (default "
                                                                          "200000; 0: no drain)")
        compare.add_argument("--rate", type=float, action="append", help="debezium: records/s of a steady run "
                                                                         "(repeatable; default 2000 and 10000)")
        compare.add_argument("--unrelated-rate", type=float, default=5000.0,
                             help="debezium: rows/s into an unrelated table, beside a steady run at the first "
                                  "--rate (default 5000; 0: no such run)")
        compare.add_argument("--duration", type=float, default=30.0, help="debezium: seconds of each steady run")
        compare.add_argument("--poll-interval-ms", type=int, default=None,
                             help="debezium: its poll.interval.ms (default Debezium's own, 500)")
        compare.add_argument("--insert", choices=["row", "transaction"], default="row",
                             help="debezium: the steady writers' INSERTs, one a row (default) or one a transaction "
                                  "(as stash_many() writes)")
        compare.add_argument("--pg-port", type=int, default=5433,
                             help="debezium: port of the private Postgres cluster with logical decoding (default "
                                  "5433)")

        tracing = sub.add_parser("tracing", help="what OpenTelemetry tracing costs stash() and a drain (on vs off)")
        tracing.add_argument("--part", choices=["stash", "drain", "both"], default="both")
        tracing.add_argument("--rows", type=int, default=20_000, help="stash rows a round (default 20000)")
        tracing.add_argument("--batch", type=int, default=100, help="stash rows a transaction (default 100)")
        tracing.add_argument("--records", type=int, default=200_000, help="drain backlog (default 200000)")
        tracing.add_argument("--keys", type=int, default=10_000)
        tracing.add_argument("--rounds", type=int, default=3)
        tracing.add_argument("--partitions", type=int, default=8)
        tracing.add_argument("--harvest-arg", action="append", default=[], dest="harvest_args")

        idle = sub.add_parser("idle", help="what an idle leader costs: mark queries per second and CPU")
        idle.add_argument("--seconds", type=float, default=30.0)
        idle.add_argument("--harvest-arg", action="append", default=[], dest="harvest_args")

        page = sub.add_parser("admin", help="admin page times on a big outbox (rows added, then removed)")
        page.add_argument("--rows", type=int, default=1_000_000)
        page.add_argument("--repeat", type=int, default=5)
        page.add_argument("--parked", type=int, default=20_000, help="rows in the dead-letter table (default 20000)")
        page.add_argument("--history-replicas", type=int, default=3,
                          help="replicas with a full hour of history samples, one every 10 s (default 3)")

    def handle(self, *args: Any, mode: str, **options: Any) -> None:
        getattr(self, f"bench_{mode}")(**options)

    # -- stash ----------------------------------------------------------------------------------

    def bench_stash(self, rows: int, batch: int, value_bytes: int, database: str, **_: Any) -> None:
        """Rows are committed (commit cost counts), then deleted; a running harvester may publish some."""
        value = "v" * value_bytes
        headers = [("source", "bench")]
        self.stdout.write(f"stash benchmark: {rows} rows of {value_bytes}-byte values, {batch} rows a transaction, "
                          f"database {database!r}")
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
            self.stdout.write(f"  {name:<14} {rows / elapsed:>10,.0f} rows/s  ({elapsed:.2f} s)")
        connections[database].close()

    @staticmethod
    def _loop(records: list[dict[str, Any]], database: str) -> None:
        for record in records:
            stash(**record, using=database)

    @staticmethod
    def _many(records: list[dict[str, Any]], database: str) -> None:
        stash_many(records, using=database)

    # -- tracing (project/bench/tracing_bench.py) -----------------------------------------------

    def bench_tracing(self, part: str, rows: int, batch: int, records: int, keys: int, rounds: int, partitions: int,
                      harvest_args: list[str], **_: Any) -> None:
        if part in ("stash", "both"):
            tracing_bench.bench_stash(self.stdout.write, rows, batch, rounds, "default")
        if part in ("drain", "both"):
            tracing_bench.bench_drain(self, records, keys, rounds, partitions, harvest_args)

    # -- drain ----------------------------------------------------------------------------------

    def bench_drain(self, records: int, keys: list[int] | None, partitions: int, harvest_args: list[str],
                    max_message_bytes: int | None = None, replicas: int = 1, standalone: bool = False,
                    **_: Any) -> None:
        self._require_empty_outbox()
        limit = f", max.message.bytes {max_message_bytes:,}" if max_message_bytes else ""
        self.stdout.write(f"drain benchmark: {records:,} records, topic with {partitions} partitions{limit}, "
                          f"{replicas} {'stand-alone ' if standalone else ''}harvester process(es), harvest flags "
                          f"{harvest_args or 'default'}")
        for key_count in keys or [10_000, 10]:
            self._vacuum()  # every run starts from a table without the last run's dead tuples
            topic = self._create_topic(f"bench-drain-{key_count}", partitions, max_message_bytes)
            began = time.perf_counter()
            pump(records=records, keys=key_count, topic=topic)
            self.stdout.write(f"  keys={key_count:<6} backlog of {records:,} written in "
                              f"{time.perf_counter() - began:.1f}s")
            leader = f"bench-leader-{uuid.uuid4().hex[:8]}"
            with contextlib.ExitStack() as stack:
                # Started together, in one group: timed from the first to lead (shards still moving to the
                # others are part of what a user waits for).
                harvesters = [stack.enter_context(HarvesterProcess(harvest_args, leader=leader,
                                                                   standalone=standalone))
                              for _ in range(replicas)]
                started = min(harvester.wait_for_leadership() for harvester in harvesters)
                while self._outbox_has_rows():
                    time.sleep(0.05)
                finished = time.time()
            elapsed = finished - started
            terms = ", ".join(str(sum("Leading with leader id" in line for line in h.lines)) for h in harvesters)
            self.stdout.write(f"  keys={key_count:<6} drained in {elapsed:6.1f}s: "
                              f"{records / elapsed:>9,.0f} records/s; harvester peak RSS "
                              f"{', '.join(f'{h.peak_rss / 2**20:.0f}' for h in harvesters)} MiB"
                              + (f"; terms led by each: {terms}" if replicas > 1 else ""))
            self._delete_topic(topic)

    # -- latency --------------------------------------------------------------------------------

    def bench_latency(self, rate: float, duration: float, keys: int, batch: int, partitions: int,
                      harvest_args: list[str], writer: str, standalone: bool = False, **_: Any) -> None:
        self._require_empty_outbox()
        topic = self._create_topic("bench-latency", partitions)
        records = int(rate * duration)
        committed: dict[int, float] = {}

        def on_commit(ids: Sequence[int], when: float) -> None:
            for record_id in ids:
                committed[record_id] = when

        self.stdout.write(f"latency benchmark: {rate:,.0f} records/s offered for {duration:.0f}s over {keys} keys, "
                          f"{batch} records a transaction, written by {writer}; "
                          f"harvest flags {harvest_args or 'default'}"
                          + ("; the stand-alone harvester" if standalone else ""))
        with HarvesterProcess(harvest_args, standalone=standalone) as harvester:
            harvester.wait_for_leadership()
            reader = AppendTimeReader(topic, expected=records)
            reader.start()
            pump(records=records, keys=keys, topic=topic, rate=rate, batch=batch, on_commit=on_commit, writer=writer)
            reader.join(timeout=120)
        warmup = min(committed.values(), default=0) + 2.0
        latencies = sorted((appended - committed[i]) * 1000 for i, appended in reader.appended.items()
                           if i in committed and committed[i] >= warmup)
        if not latencies:
            raise CommandError("no records were read back from Kafka")

        def pct(p: float) -> float:
            return latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))]

        self.stdout.write(f"  commit-to-ack over {len(latencies):,} records (first 2 s excluded): "
                          f"p50 {pct(50):.1f} ms, p95 {pct(95):.1f} ms, p99 {pct(99):.1f} ms, "
                          f"max {latencies[-1]:.1f} ms, mean {statistics.fmean(latencies):.1f} ms")
        self.stdout.write(f"  harvester peak RSS {harvester.peak_rss / 2**20:.0f} MiB; "
                          f"read back {len(reader.appended):,} of {records:,}")
        self._delete_topic(topic)

    # -- what it costs the database --------------------------------------------------------------

    def bench_dbcost(self, records: int, keys: int, rate: list[float] | None, duration: float, batch: int | None,
                     partitions: int, harvest_args: list[str], writer: str = "sql", **_: Any) -> None:
        """The writer's own cost and the harvester's, measured on the server in the same run."""
        self._require_empty_outbox()
        meter = dbcost.ServerMeter(psycopg.connect(conf.harvest_config().dsn, autocommit=True))
        statements = "per statement kind" if meter.has_statements else f"(kinds not shown: {meter.without_statements})"
        self.stdout.write(f"database cost: Postgres CPU (all server processes) and WAL, {statements}; "
                          f"harvest flags {harvest_args or 'default'}")
        if records:
            self._vacuum()
            topic = self._create_topic("bench-dbcost", partitions)
            before = meter.read()
            pump(records=records, keys=keys, topic=topic)  # stash_many(), 1,000 rows a statement
            written = meter.read()
            with HarvesterProcess(harvest_args) as harvester:
                harvester.wait_for_leadership()
                self._wait_drained()
                drained = meter.read()
            self._report(f"drain of {records:,} rows over {keys:,} keys", records, written - before,
                         drained - written)
            self._delete_topic(topic)
        for offered in rate if rate is not None else [2000.0, 10000.0]:
            if offered <= 0:
                continue
            count = int(offered * duration)
            size = batch or max(1, int(offered / 100))
            topic = self._create_topic("bench-dbcost", partitions)
            self._vacuum()
            with HarvesterProcess(harvest_args) as harvester:
                harvester.wait_for_leadership()
                time.sleep(1.0)  # past start-up
                before, sessions = meter.read(), meter.sessions(APPLICATION_PREFIX)
                pump(records=count, keys=keys, topic=topic, rate=offered, batch=size, writer=writer)
                self._wait_drained()
                both = meter.read() - before
                own = dbcost.session_cpu(sessions, meter.sessions(APPLICATION_PREFIX))
            self._vacuum()
            before = meter.read()
            pump(records=count, keys=keys, topic=topic, rate=offered, batch=size, writer=writer)
            alone = meter.read() - before
            with HarvesterProcess(harvest_args):  # clean up, unmeasured
                self._wait_drained()
            self._report(f"steady {offered:,.0f} records/s for {duration:.0f}s, {size} a transaction, written by "
                         f"{writer}", count, alone,
                         both - alone, both)
            self.stdout.write(f"    the harvester's own sessions: CPU {sum(own.values()):.2f} s "
                              f"= {sum(own.values()) / max(alone.cpu, 1e-9):.2f}x the writer's "
                              f"({', '.join(f'{kind} {cpu:.2f} s' for kind, cpu in own.items())})")
            self._delete_topic(topic)

    @staticmethod
    def _wait_drained() -> None:
        """Poll for an empty outbox, rarely and tagged, so the poll costs the server little and is not
        counted among the harvester's statements."""
        with connections["default"].cursor() as cursor:
            while True:
                cursor.execute(f'/* bench */ SELECT EXISTS (SELECT 1 FROM "{OutboxRecord._meta.db_table}")')
                if not cursor.fetchone()[0]:
                    return
                time.sleep(0.25)

    def _report(self, title: str, records: int, writer: dbcost.Cost, harvest: dbcost.Cost,
                together: dbcost.Cost | None = None) -> None:
        self.stdout.write(f"  {title}:")
        self.stdout.write(f"    writer    CPU {writer.cpu:6.2f} s  WAL {writer.wal_bytes / 2**20:7.1f} MiB "
                          f"({writer.wal_bytes / records:6.0f} B/record)")
        self.stdout.write(f"    harvest   CPU {harvest.cpu:6.2f} s  WAL {harvest.wal_bytes / 2**20:7.1f} MiB "
                          f"({harvest.wal_bytes / records:6.0f} B/record)  "
                          f"= {harvest.cpu / max(writer.cpu, 1e-9):.2f}x the writer's CPU, "
                          f"{harvest.wal_bytes / max(writer.wal_bytes, 1):.2f}x its WAL")
        statements = (together or harvest).statements - (writer.statements if together is not None
                                                          else dbcost.Statements())
        self.stdout.write("    harvester's statements:")
        for line in dbcost.Cost(0, 0, statements).lines(records, indent="      "):
            self.stdout.write(line)

    # -- hours under load --------------------------------------------------------------------------

    def bench_soak(self, minutes: float, rate: float, keys: int, harvesters: int, partitions: int,
                   hold_transaction: str | None, harvest_args: list[str], warmup: float, **_: Any) -> None:
        if warmup < 0:
            raise CommandError(f"--warmup: at least 0 seconds, got {warmup:g}")
        self._require_empty_outbox()
        hold = None
        if hold_transaction:
            try:
                start, length = (float(part) for part in hold_transaction.split(":"))
            except ValueError:
                raise CommandError(f"--hold-transaction: START:MINUTES, got {hold_transaction!r}") from None
            hold = (start, length)
        topic = self._create_topic("bench-soak", partitions)
        self._vacuum()
        ports = [free_port() for _ in range(harvesters)]
        held = f"an old transaction from minute {hold[0]:g} for {hold[1]:g}" if hold else "no old transaction"
        self.stdout.write(f"soak: {minutes:g} min at {rate:,.0f} records/s (half plain SQL, half stash_many) over "
                          f"{keys} keys, {harvesters} harvester(s), after a {warmup:g} s warm-up; {held}; "
                          f"harvest flags {harvest_args or 'default'}")

        def write(kind: str, share: float, seconds: float, committed: soak.Committed, stop: Any) -> None:
            pump(records=int(share * seconds), keys=keys, topic=topic, rate=share, batch=20, on_commit=committed.add,
                 writer=kind, stop=stop)

        def queries(harvester: HarvesterProcess) -> tuple[float, float, float, float]:
            port = harvester.metrics_port
            return (scrape(port, "outbox_mark_seconds_count"), scrape(port, "outbox_mark_seconds_sum"),
                    scrape(port, "outbox_purge_seconds_count"), scrape(port, "outbox_purge_seconds_sum"))

        unwind_on_sigterm()  # the writers stop, and so do the harvesters started here
        with contextlib.ExitStack() as stack:
            running = []
            for port in ports:
                harvester = stack.enter_context(HarvesterProcess(
                    [*harvest_args, "--metrics-port", str(port), "--metrics-address", "127.0.0.1"]))
                harvester.metrics_port = port
                running.append(harvester)
            running[0].wait_for_leadership()
            time.sleep(1.0)  # the metrics endpoints are up
            result = soak.soak(dsn=conf.harvest_config().dsn, bootstrap=conf.kafka_config()["bootstrap.servers"],
                               topic=topic, table=OutboxRecord._meta.db_table, minutes=minutes, rate=rate,
                               write=write, harvesters=running, scrape=queries, hold=hold, say=self.stdout.write,
                               warmup=warmup)
            self._wait_drained()
        self.stdout.write(result.line())
        self._delete_topic(topic)

    # -- side by side with goharvest ------------------------------------------------------------

    def bench_compare(self, peer: str, reaper: str | None, backlog: list[str] | None, partitions: int,
                      harvest_args: list[str], **options: Any) -> None:
        if peer == "debezium":
            self._compare_debezium(harvest_args=harvest_args, **options)
        else:
            self._compare_goharvest(reaper, backlog, partitions, harvest_args)

    def _compare_debezium(self, *, rounds: int, records: int, rate: list[float] | None, unrelated_rate: float,
                          duration: float, poll_interval_ms: int | None, pg_port: int, harvest_args: list[str],
                          insert: str = "row", **_: Any) -> None:
        """project/bench/side_by_side.py: both relays on a private cluster with logical decoding."""
        from project.bench.debezium import DEFAULT_POLL_MS
        from project.bench.side_by_side import SideBySide, Workload

        for name, value, least in (("--rounds", rounds, 1), ("--records", records, 0), ("--duration", duration, 1),
                                   ("--pg-port", pg_port, 1), ("--poll-interval-ms", poll_interval_ms or 1, 1)):
            if value < least:
                raise CommandError(f"{name}: must be at least {least}, got {value}")
        own_port = int(psycopg.conninfo.conninfo_to_dict(conf.harvest_config().dsn).get("port") or 5432)
        if pg_port == own_port:
            raise CommandError(f"--pg-port: {pg_port} is the project's own Postgres; the benchmark runs a cluster of "
                               "its own on another port")
        rates = rate or [2000.0, 10000.0]
        if any(r <= 0 for r in rates) or unrelated_rate < 0:
            raise CommandError(f"--rate and --unrelated-rate: must be positive, got {rates} and {unrelated_rate}")
        workloads = [Workload(r) for r in rates] + ([Workload(rates[0], unrelated_rate)] if unrelated_rate else [])
        bootstrap = conf.harvest_config().base_kafka_config["bootstrap.servers"]
        poll = poll_interval_ms or DEFAULT_POLL_MS
        self.stdout.write(f"side by side with Debezium: {rounds} round(s); drain of {records:,}; "
                          f"{', '.join(w.name for w in workloads)} for {duration:.0f} s each, one INSERT a {insert}; "
                          f"Debezium's poll.interval.ms {poll}; harvest flags {harvest_args or 'default'}")
        side = SideBySide(self.stdout.write, bootstrap, pg_port=pg_port, poll_interval_ms=poll,
                          harvest_args=harvest_args, project_dsn=conf.harvest_config().dsn, insert=insert)
        unwind_on_sigterm()
        try:
            side.setup()
            report = side.run(rounds, records, workloads, duration)
        except (RuntimeError, OSError, psycopg.Error) as error:
            raise CommandError(f"side by side with Debezium: {error}") from None
        finally:
            side.close()  # the private cluster stopped, the writers' commit logs removed
        for line in report.table():
            self.stdout.write(line)

    def _compare_goharvest(self, reaper: str | None, backlog: list[str] | None, partitions: int,
                           harvest_args: list[str]) -> None:
        """Each backlog drained by this harvester, then by goharvest's reaper, measured the same way:
        from the first row purged to the table empty."""
        if not reaper:
            raise CommandError("--reaper: required with --peer goharvest (the path to goharvest's reaper binary)")
        self._require_empty_outbox()
        if not Path(reaper).is_file():
            raise CommandError(f"--reaper: no such file {reaper!r}")
        backlogs = [tuple(int(n) for n in item.split(":")) for item in backlog or ["1000000:10000", "60000:10",
                                                                                   "20000:1"]]
        self.stdout.write(f"side by side: harvest flags {harvest_args or 'default'}; goharvest {reaper} with its "
                          f"defaults; {partitions} partitions")
        for records, keys in backlogs:
            rates = []
            for name, process in (("this harvester", lambda: HarvesterProcess(harvest_args)),
                                  # goharvest does not create its leader topic
                                  ("goharvest", lambda: ReaperProcess(reaper, self._create_topic("bench-reaper", 1)))):
                self._vacuum()
                topic = self._create_topic(f"bench-compare-{keys}", partitions)
                pump(records=records, keys=keys, topic=topic)
                with process() as harvester:
                    rate = self._drain_rate(records, harvester)
                rates.append(rate)
                self.stdout.write(f"  {records:>9,} over {keys:>6,} keys  {name:<15} {rate:>9,.0f} records/s, "
                                  f"peak RSS {harvester.peak_rss / 2**20:.0f} MiB")
                self._delete_topic(topic)
            self.stdout.write(f"  {records:>9,} over {keys:>6,} keys  ratio {rates[0] / rates[1]:.1f}x")

    def _drain_rate(self, records: int, harvester: HarvesterProcess, timeout: float = 1800) -> float:
        """records/s from the first purge to the last (the table's lowest id moving, then no rows)."""
        table = OutboxRecord._meta.db_table
        with connections["default"].cursor() as cursor:
            cursor.execute(f'SELECT min(id) FROM "{table}"')
            first = cursor.fetchone()[0]
            deadline = time.monotonic() + timeout
            started = None
            while time.monotonic() < deadline:
                cursor.execute(f'SELECT min(id) FROM "{table}"')
                lowest = cursor.fetchone()[0]
                now = time.monotonic()
                if started is None and lowest != first:
                    started = now
                if lowest is None:
                    return records / (now - started)
                if harvester.process.poll() is not None:
                    raise CommandError("the harvester exited: " + "".join(harvester.lines[-5:]).strip())
                time.sleep(0.05)
        raise CommandError("the outbox did not drain in time")

    # -- idle -----------------------------------------------------------------------------------

    def bench_idle(self, seconds: float, harvest_args: list[str], **_: Any) -> None:
        """An idle leader's mark queries per second (from its metrics) and its CPU use."""
        self._require_empty_outbox()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        args = [*harvest_args, "--metrics-port", str(port), "--metrics-address", "127.0.0.1"]
        self.stdout.write(f"idle benchmark: {seconds:.0f}s of an idle leader; "
                          f"harvest flags {harvest_args or 'default'}")
        with HarvesterProcess(args) as harvester:
            harvester.wait_for_leadership()
            time.sleep(2.0)  # past start-up
            process = psutil.Process(harvester.process.pid)
            marks, cpu, began = scrape(port, "outbox_mark_seconds_count"), process.cpu_times(), time.monotonic()
            time.sleep(seconds)
            elapsed = time.monotonic() - began
            marks = scrape(port, "outbox_mark_seconds_count") - marks
            used = sum(process.cpu_times()[:2]) - sum(cpu[:2])
        self.stdout.write(f"  {marks / elapsed:.2f} mark queries/s, {100 * used / elapsed:.2f}% of a core, "
                          f"peak RSS {harvester.peak_rss / 2**20:.0f} MiB")

    # -- admin ----------------------------------------------------------------------------------

    def bench_admin(self, rows: int, repeat: int, parked: int, history_replicas: int = 3, **_: Any) -> None:
        """Time the dashboard and the records pages on an outbox of `rows` rows, with a live leader
        (a status row written by the engine's own status writer) holding one record of a busy key, and a full
        hour of history for `history_replicas` replicas (the dashboard's charts)."""
        from django.contrib.auth.models import User
        from django.test import Client

        from outbox.models import DeadLetter

        self._require_empty_outbox()
        table = OutboxRecord._meta.db_table
        dead_letters = DeadLetter._meta.db_table
        leader_id = uuid.uuid4()
        with connections["default"].cursor() as cursor:
            # Generated server-side: this measures the pages, not stash(). 10,000 keys of 100 rows;
            # the first 1,000 rows marked by a leader that is gone, the next 500 by the live leader.
            cursor.execute(f"""
                INSERT INTO "{table}" (kafka_topic, kafka_key, kafka_value, leader_id, reset_count, last_error)
                SELECT 'bench-admin-' || (g %% 7), 'key-' || (g %% 10000), repeat('v', 100),
                       CASE WHEN g <= 1000 THEN '00000000-0000-0000-0000-00000000dead'::uuid
                            WHEN g <= 1500 THEN %s::uuid END,
                       CASE WHEN g %% 50000 = 0 THEN 5 ELSE 0 END,
                       CASE WHEN g %% 50000 = 0 THEN 'Broker: Message size too large' END
                FROM generate_series(1, %s) AS g""", [leader_id, rows])
            # A poison record of key-4242, held by the live leader: its 99 later rows wait behind it.
            cursor.execute(f"""UPDATE "{table}" SET leader_id = %s, reset_count = 3,
                               last_error = 'Broker: Message size too large'
                               WHERE id = (SELECT min(id) FROM "{table}" WHERE kafka_key = 'key-4242')
                               RETURNING id, kafka_topic""", [leader_id])
            held_id, held_topic = cursor.fetchone()
            cursor.execute(f"""
                INSERT INTO "{dead_letters}" (outbox_id, create_time, kafka_topic, kafka_key, kafka_value,
                                              kafka_header_keys, kafka_header_values, reason, attempts, parked_at,
                                              parked_by)
                SELECT -g, now(), 'bench-admin', 'key-' || g, 'v', '{{}}', '{{}}', 'Broker: Message size too large', 3,
                       now(), 'harvester bench' FROM generate_series(1, %s) AS g""", [parked])
            cursor.execute(f'ANALYZE "{table}"')
            cursor.execute(f'ANALYZE "{dead_letters}"')
        self._hour_of_history(history_replicas)
        reporter = self._leader_status(leader_id, HeldRecord(held_id, "key-4242", held_topic,
                                                             "Broker: Message size too large", 3, 120.0, 99, False))
        user = User.objects.create_superuser(f"bench-{uuid.uuid4().hex[:8]}", "bench@example.com", None)
        client = Client()
        client.force_login(user)
        records = "/admin/outbox/outboxrecord/"
        pages = [("dashboard", "/admin/outbox/dashboard/"), ("records", records),
                 ("records, page 100", f"{records}?p=100")]
        pages += [(f"records, {state}", f"{records}?state={state}")
                  for state in ("waiting", "in_flight", "held", "behind", "stuck")]
        pages += [("records, topic", f"{records}?topic=bench-admin-3"),
                  ("record detail", f"{records}{self._first_id()}/change/"),
                  ("parked records", "/admin/outbox/deadletter/")]
        self.stdout.write(f"admin benchmark: {rows:,} rows in the outbox, one held (99 behind it), {parked:,} "
                          f"parked, an hour of history of {history_replicas} replica(s); median of {repeat} requests")
        try:
            with override_settings(ALLOWED_HOSTS=["testserver"], DEBUG=False):
                for name, url in pages:
                    times = []
                    for _ in range(repeat):
                        began = time.perf_counter()
                        response = client.get(url)
                        times.append((time.perf_counter() - began) * 1000)
                        if response.status_code != 200:
                            raise CommandError(f"{url} answered {response.status_code}")
                    self.stdout.write(f"  {name:<20} {statistics.median(times):7.1f} ms  (max {max(times):.1f} ms)")
        finally:
            reporter.stop()
            reporter.join()
            user.delete()
            with connections["default"].cursor() as cursor:
                cursor.execute(f'TRUNCATE "{table}"')
                cursor.execute(f'DELETE FROM "{dead_letters}" WHERE outbox_id < 0')
                cursor.execute(f'DELETE FROM "{HarvesterSample._meta.db_table}" WHERE name LIKE %s',
                               ["bench-history-%"])

    @staticmethod
    def _hour_of_history(replicas: int) -> None:
        """An hour of samples, one every 10 s (the default history_interval), of `replicas` replicas taking
        the lead in turn, as their status reporters write them: with what the database paid (round trips, and
        the leader's read of pg_stat_statements) by kind."""
        with connections["default"].cursor() as cursor:
            cursor.execute(f"""
                INSERT INTO "{HarvesterSample._meta.db_table}" (name, at, state, leader_id, since, harvested_table,
                    leader_group, published, failed, in_flight, queued, held, backlog, oldest_age, db_round_trips,
                    db_statements)
                SELECT 'bench-history-' || r, now() - make_interval(secs => 10 * (359 - s)),
                       CASE WHEN s / (360 / %(replicas)s) = r THEN 'leader' ELSE 'standby' END, NULL,
                       now() - make_interval(secs => 10 * (359 - (r * (360 / %(replicas)s)))),
                       'outbox', 'bench', s * 20000, s, 4000, 0, 1, 1000000 - s * 1000, 30 + s,
                       jsonb_build_object('mark', jsonb_build_array(s * 100, s * 0.15, s * 20000),
                                          'purge', jsonb_build_array(s * 1000, s * 1.2, s * 20000),
                                          'fence', jsonb_build_array(1, 0.001, 0)),
                       CASE WHEN s / (360 / %(replicas)s) = r THEN jsonb_build_object(
                           'mark', jsonb_build_array(s * 100, s * 0.04, s * 20000),
                           'writers', jsonb_build_array(s * 100, s * 0.02, 0),
                           'gaps', jsonb_build_array(s * 3, s * 0.001, s),
                           'purge', jsonb_build_array(s * 1000, s * 0.11, s * 1000),
                           'fence', jsonb_build_array(2, 0.0001, 2),
                           'status', jsonb_build_array(s * 12, s * 0.006, s * 12)) END
                FROM generate_series(0, %(replicas)s - 1) AS r, generate_series(0, 359) AS s""",
                           {"replicas": replicas})

    @staticmethod
    def _leader_status(leader_id: uuid.UUID, held: HeldRecord) -> BoardReporter:
        """A live leader's status row, written by the engine's own reporter (removed when it stops)."""
        from datetime import UTC, datetime

        config = conf.harvest_config(name=f"bench-admin-{uuid.uuid4().hex[:6]}", status_interval=1.0)
        now = datetime.now(UTC)
        snapshot = StatusSnapshot(state=ReplicaState.LEADER, leader_id=leader_id, since=now, in_flight=500, queued=0,
                                  in_flight_keys=[f"key-{i}" for i in range(1001, 1051)], in_flight_key_count=500,
                                  held=[held], blocked_by=None, throughput=0.0, published=0, failed=0)
        reporter = StatusBoards().reporter(config, lambda: snapshot, lambda _rows: None)
        if reporter is None:
            raise CommandError(f"no status table {config.status_table}: run manage.py migrate")
        reporter.start()
        deadline = time.monotonic() + 10
        while not HarvesterStatus.objects.filter(name=config.name).exists():
            if time.monotonic() > deadline:
                raise CommandError("the leader's status row did not appear within 10 s")
            time.sleep(0.05)
        return reporter

    @staticmethod
    def _first_id() -> int:
        return OutboxRecord.objects.order_by("id").values_list("id", flat=True).first()

    # -- helpers --------------------------------------------------------------------------------

    def _require_empty_outbox(self) -> None:
        if self._outbox_has_rows():
            raise CommandError("the outbox is not empty: benchmarks need an empty outbox and no harvester running")

    @staticmethod
    def _vacuum() -> None:
        with connections["default"].cursor() as cursor:
            cursor.execute(f'VACUUM ANALYZE "{OutboxRecord._meta.db_table}"')

    @staticmethod
    def _outbox_has_rows() -> bool:
        with connections["default"].cursor() as cursor:
            cursor.execute(f'SELECT EXISTS (SELECT 1 FROM "{OutboxRecord._meta.db_table}")')
            return cursor.fetchone()[0]

    def _admin(self) -> AdminClient:
        # One client for the command's lifetime: a destroyed client fails its pending futures.
        if not hasattr(self, "_admin_client"):
            self._admin_client = AdminClient(
                {"bootstrap.servers": conf.harvest_config().base_kafka_config["bootstrap.servers"]})
        return self._admin_client

    def _create_topic(self, prefix: str, partitions: int, max_message_bytes: int | None = None) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        # LogAppendTime: a message's timestamp is when the broker appended it, i.e. about when it was acked.
        config = {"message.timestamp.type": "LogAppendTime"}
        if max_message_bytes:
            config["max.message.bytes"] = str(max_message_bytes)
        topic = NewTopic(name, num_partitions=partitions, config=config)
        self._admin().create_topics([topic])[name].result(timeout=30)
        return name

    def _delete_topic(self, name: str) -> None:
        self._admin().delete_topics([name])[name].result(timeout=30)


class HarvesterProcess:
    """`manage.py harvest` (or, `standalone`, `python -m outbox.harvest` on the same database and broker) in a
    subprocess with a fresh leader topic; samples its RSS."""

    def __init__(self, extra_args: Sequence[str], env: dict[str, str] | None = None, leader: str | None = None,
                 standalone: bool = False) -> None:
        leader = leader or f"bench-leader-{uuid.uuid4().hex[:8]}"
        self.env = {**os.environ, **env} if env else None
        command = [str(manage_py()), "harvest"]
        if standalone:
            command = ["-m", "outbox.harvest"]
            self.env = {**(self.env or os.environ), "DATABASE_URL": conf.dsn_for("default"),
                        "KAFKA_BOOTSTRAP_SERVERS": conf.kafka_config()["bootstrap.servers"]}
        self.args = [sys.executable, *command, "--leader-topic", leader, "--leader-group", leader,
                     "-v", "2" if os.environ.get("OUTBOX_BENCH_DEBUG") else "1", *extra_args]
        self.peak_rss = 0
        self._done = threading.Event()
        self.lines: list[str] = []

    def __enter__(self) -> HarvesterProcess:
        self.process = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        env=self.env)
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return self

    def _read_log(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line)

    def _sample(self) -> None:
        process = psutil.Process(self.process.pid)
        while not self._done.is_set():
            try:
                self.peak_rss = max(self.peak_rss, process.memory_info().rss)
            except psutil.Error:
                return
            self._done.wait(0.1)

    def wait_for_leadership(self, timeout: float = 60) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any("Leading with leader id" in line for line in self.lines):
                return time.time()
            if self.process.poll() is not None:
                raise CommandError("harvester exited: " + "".join(self.lines[-5:]).strip())
            time.sleep(0.01)
        raise CommandError("harvester did not lead within 60s")

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


class ReaperProcess(HarvesterProcess):
    """goharvest's reaper in a subprocess, configured like the harvester (same table, database, Kafka)."""

    def __init__(self, binary: str, leader: str) -> None:
        super().__init__(())
        database = connections["default"].settings_dict
        self._config = Path(tempfile.mkdtemp()) / "reaper.yaml"
        self._config.write_text(
            "harvest:\n"
            f"  baseKafkaConfig:\n    bootstrap.servers: {conf.kafka_config()['bootstrap.servers']}\n"
            f"  leaderTopic: {leader}\n  leaderGroupID: {leader}\n"
            f"  dataSource: host={database['HOST'] or 'localhost'} port={database['PORT'] or 5432} "
            f"user={database['USER']} password={database['PASSWORD']} dbname={database['NAME']} sslmode=disable\n"
            f"  outboxTable: {OutboxRecord._meta.db_table}\n"
            "logging:\n  level: Info\n")
        self.args = [binary, "-f", str(self._config)]


class AppendTimeReader(threading.Thread):
    """Reads the benchmark topic and keeps each outbox id's broker append time (seconds)."""

    def __init__(self, topic: str, expected: int) -> None:
        super().__init__(daemon=True)
        self.topic, self.expected = topic, expected
        self.appended: dict[int, float] = {}

    def run(self) -> None:
        bootstrap = conf.harvest_config().base_kafka_config["bootstrap.servers"]
        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex}",
                             "enable.auto.commit": False, "auto.offset.reset": "earliest"})
        partitions = consumer.list_topics(self.topic, timeout=30).topics[self.topic].partitions
        consumer.assign([TopicPartition(self.topic, p, 0) for p in partitions])
        idle_deadline = time.monotonic() + 60
        while len(self.appended) < self.expected and time.monotonic() < idle_deadline:
            for message in consumer.consume(1000, timeout=0.5):
                if message.error():
                    if message.error().code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(message.error().str())
                    continue
                idle_deadline = time.monotonic() + 30
                for name, value in message.headers() or []:
                    if name == "outbox-id":
                        self.appended.setdefault(int(value), message.timestamp()[1] / 1000)
        consumer.close()


def unwind_on_sigterm() -> None:
    """A SIGTERM (a timeout, CI, `kill`) unwinds like Ctrl-C, so that what the benchmark started is stopped."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(port: int, name: str) -> float:
    """One value from a harvester's Prometheus endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rpartition(" ")[2])
    raise CommandError(f"the harvester's metrics have no {name}")


def manage_py() -> Path:
    candidate = Path(sys.argv[0]).resolve()
    if candidate.name == "manage.py":
        return candidate
    raise CommandError("run the benchmark through manage.py so that the harvester can be started the same way")
