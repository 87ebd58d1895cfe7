"""Hours under load: writers at a steady rate, harvesters, a consumer; a line of figures every minute.

    manage.py outbox_bench soak --minutes 60 --rate 2000 [--hold-transaction 20:10]

Two writers share the rate: plain SQL (as an application in any language would write) and
stash_many(). A consumer reads the topic back and times each record from its commit to the broker's
append (LogAppendTime). Every minute: records/s acknowledged, commit-to-ack p50/p99, backlog and
its oldest row, the table's and its indexes' size and dead rows, the harvesters' RSS and CPU, the
mark and purge query times (their metrics), and what the minute cost Postgres (CPU of all its
processes, autovacuum included, and WAL) per record. `--hold-transaction START:MINUTES` holds a
REPEATABLE READ transaction open for part of the run, as a forgotten session would. It ends with one
line: the verdict against the targets of docs/benchmarks.md, "Hours under load".

The writers start `--warmup` seconds (30 by default) before the first minute: a Kafka broker's JVM
compiles its produce path in the first 20-30 s of load after it starts, and a new topic's first
produce waits for its metadata, which put commit-to-ack p99 at 100 ms or more in the first minute
of a soak on a freshly started broker and 12-15 ms on a warm one (docs/benchmarks.md). The warm-up's
records are delivered and checked like the others; their figures are said on a line of their own and
left out of the minutes and the verdict.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil
import psycopg
from confluent_kafka import Consumer, KafkaError, TopicPartition

from project.bench.dbcost import ServerMeter

#: The soak's targets (docs/benchmarks.md): the verdict line checks the run against them.
THROUGHPUT_DRIFT = 0.10  # last 10 minutes within 10% of the first 10
P99_MS = 20.0  # every minute, without an old transaction
P99_HELD_MS = 100.0  # every minute while one is held
SIZE_GROWTH = 2.0  # table plus indexes at most twice their size after the first 10 minutes
RSS_GROWTH_MIB = 10.0  # the harvester's RSS growth over the run
BACKLOG_SECONDS = 2.0  # the backlog never exceeds this many seconds of writes


@dataclass
class Minute:
    index: int
    acked: int = 0
    latencies: list[float] = field(default_factory=list)
    backlog: int = 0
    oldest_age: float = 0.0
    size_mib: float = 0.0
    dead_rows: int = 0
    rss_mib: float = 0.0
    cpu_percent: float = 0.0
    mark_ms: float = 0.0
    purge_ms: float = 0.0
    pg_cpu_us: float = 0.0  # Postgres CPU per record acknowledged, microseconds
    wal_bytes: float = 0.0  # WAL per record
    held: bool = False

    def p(self, percent: float) -> float:
        if not self.latencies:
            return 0.0
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(percent / 100 * len(ordered)))]

    def line(self) -> str:
        return (f"  min {self.index:>3}: {self.acked / 60:>8,.0f} records/s  p50 {self.p(50):6.1f} ms  "
                f"p99 {self.p(99):7.1f} ms  backlog {self.backlog:>7,} (oldest {self.oldest_age:5.1f} s)  "
                f"table {self.size_mib:7.1f} MiB  dead {self.dead_rows:>9,}  harvester {self.rss_mib:5.0f} MiB "
                f"{self.cpu_percent:4.0f}% CPU  mark {self.mark_ms:5.2f} ms  purge {self.purge_ms:5.2f} ms  "
                f"Postgres (whole server) {self.pg_cpu_us:5.1f} us/record {self.wal_bytes:5.0f} B/record"
                f"{'  [old transaction open]' if self.held else ''}")


class Committed:
    """Commit time of each outbox id (shared by the writers)."""

    def __init__(self) -> None:
        self.times: dict[int, float] = {}
        self.lock = threading.Lock()

    def add(self, ids: Any, when: float) -> None:
        with self.lock:
            for record_id in ids:
                self.times[record_id] = when


class Reader(threading.Thread):
    """Reads the topic from its start until stopped; keeps each outbox id's broker append time."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.bootstrap, self.topic = bootstrap, topic
        self.appended: dict[int, float] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    def run(self) -> None:
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": f"soak-{uuid.uuid4().hex}",
                             "enable.auto.commit": False, "auto.offset.reset": "earliest"})
        partitions = consumer.list_topics(self.topic, timeout=30).topics[self.topic].partitions
        consumer.assign([TopicPartition(self.topic, p, 0) for p in partitions])
        while not self.stopping.is_set():
            for message in consumer.consume(2000, timeout=0.2):
                if message.error():
                    if message.error().code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(message.error().str())
                    continue
                for name, value in message.headers() or []:
                    if name == "outbox-id":
                        with self.lock:
                            self.appended.setdefault(int(value), message.timestamp()[1] / 1000)
        consumer.close()


class OldTransaction:
    """A REPEATABLE READ transaction left open, as a forgotten session would: it holds the horizon."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.conn: psycopg.Connection | None = None

    def begin(self) -> None:
        self.conn = psycopg.connect(self.dsn, application_name="soak-old-transaction")
        self.conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        self.conn.execute("SELECT count(*) FROM pg_class").fetchone()

    def end(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


@dataclass
class Verdict:
    ok: bool
    reasons: list[str]

    def line(self) -> str:
        return ("verdict: PASS" if self.ok else "verdict: FAIL") + (f" ({'; '.join(self.reasons)})"
                                                                     if self.reasons else "")


def verdict(minutes: list[Minute], rate: float, rss_start: float) -> Verdict:
    """The run against the targets; a run under ten minutes compares its first and last thirds."""
    reasons = []
    span = max(1, min(10, len(minutes) // 3))
    first = sum(m.acked for m in minutes[:span]) / span
    last = sum(m.acked for m in minutes[-span:]) / span
    if first and abs(last - first) / first > THROUGHPUT_DRIFT:
        reasons.append(f"throughput of the last {span} min {last / 60:,.0f}/s vs the first {first / 60:,.0f}/s")
    for minute in minutes:
        bound = P99_HELD_MS if minute.held else P99_MS
        if minute.p(99) > bound:
            reasons.append(f"p99 {minute.p(99):.1f} ms in minute {minute.index} (target {bound:g})")
        if minute.held and minute.backlog > BACKLOG_SECONDS * rate:
            reasons.append(f"backlog {minute.backlog:,} in minute {minute.index} "
                           f"(target {BACKLOG_SECONDS * rate:,.0f})")
    settled = minutes[span - 1].size_mib if len(minutes) > span else None
    if settled and minutes[-1].size_mib > SIZE_GROWTH * settled:
        reasons.append(f"table plus indexes grew from {settled:.1f} to {minutes[-1].size_mib:.1f} MiB")
    growth = minutes[-1].rss_mib - rss_start
    if growth > RSS_GROWTH_MIB:
        reasons.append(f"harvester RSS grew {growth:.1f} MiB")
    return Verdict(not reasons, reasons)


#: A plain table is its own leaf; a partitioned one's leaves are its partitions (pg_partition_tree lists
#: nothing for a table that is not partitioned).
TABLE_FIGURES = """
WITH leaves AS (
    SELECT relid FROM pg_partition_tree(to_regclass(%(table)s)) WHERE isleaf
    UNION ALL
    SELECT to_regclass(%(table)s) WHERE NOT EXISTS (
        SELECT 1 FROM pg_partitioned_table WHERE partrelid = to_regclass(%(table)s)))
SELECT coalesce(sum(s.n_live_tup), 0), coalesce(sum(s.n_dead_tup), 0), coalesce(sum(pg_total_relation_size(s.relid)), 0)
FROM leaves JOIN pg_stat_user_tables s ON s.relid = leaves.relid
"""


def table_figures(conn: psycopg.Connection, table: str) -> tuple[int, float, float, int]:
    """(live rows estimate, oldest row's age in seconds, table plus indexes in MiB, dead rows), summed over
    the partitions of a partitioned outbox (its parent holds no rows of its own)."""
    row = conn.execute(TABLE_FIGURES, {"table": table}).fetchone()
    oldest = conn.execute(f'SELECT extract(epoch FROM now() - create_time) FROM "{table}" ORDER BY id LIMIT 1'
                          ).fetchone()
    live, dead, size = row if row else (0, 0, 0)
    return int(live), float(oldest[0]) if oldest else 0.0, float(size) / 2**20, int(dead)


#: The tables the outbox and the queues keep besides the outbox itself, each with a retention.
OTHER_TABLES = ("outbox_dead_letter", "outbox_harvester", "outbox_harvester_history", "outbox_queue_dead_letter",
                "outbox_queue_inbox", "outbox_queue_process", "outbox_queue_history")


def other_tables(conn: psycopg.Connection) -> str:
    """Rows (estimated) and size of each table the soak does not write but the harvesters do."""
    rows = conn.execute(
        "SELECT relname, n_live_tup, pg_total_relation_size(relid) FROM pg_stat_user_tables "
        "WHERE relname = ANY(%s) ORDER BY relname", [list(OTHER_TABLES)]).fetchall()
    return ", ".join(f"{name} {live:,} rows {size / 2**20:.2f} MiB" for name, live, size in rows)


def latencies_ms(times: dict[int, float], appended: dict[int, float], since: float, until: float,
                 wall: float) -> list[float]:
    """Commit to append of the records committed in [since, until); one not yet appended counts with the
    time it has waited so far (until `wall`), so a stall shows as one."""
    return [(appended.get(i, wall) - when) * 1000 for i, when in times.items() if since <= when < until]


def soak(*, dsn: str, bootstrap: str, topic: str, table: str, minutes: float, rate: float,
         write: Callable[[str, float, float, Committed, threading.Event], None],
         harvesters: list[Any], scrape: Callable[[Any], tuple[float, float, float, float]],
         hold: tuple[float, float] | None, say: Callable[[str], None], warmup: float = 0.0) -> Verdict:
    """Run the soak; `write(kind, rate, seconds, committed, stop)` writes, `scrape(harvester)` answers
    the (mark count, mark seconds, purge count, purge seconds) so far. The writers start `warmup`
    seconds before the first minute."""
    committed = Committed()
    reader = Reader(bootstrap, topic)
    reader.start()
    stop = threading.Event()
    seconds = minutes * 60
    writers = [threading.Thread(target=write, args=(kind, rate / 2, warmup + seconds, committed, stop), daemon=True)
               for kind in ("sql", "stash")]
    meter_conn = psycopg.connect(dsn, autocommit=True)
    try:
        meter: ServerMeter | None = ServerMeter(meter_conn, table)
    except RuntimeError as error:  # a server elsewhere: its CPU cannot be read from here
        say(f"  (Postgres CPU and WAL not measured: {error})")
        meter = None
    if meter is not None and meter.without_statements:
        say(f"  (the cost per kind of statement not measured: {meter.without_statements})")
    processes = [psutil.Process(h.process.pid) for h in harvesters]
    old = OldTransaction(dsn)
    say(f"  other tables at the start: {other_tables(meter_conn)}")
    for writer in writers:
        writer.start()
    warm_began = time.time()
    time.sleep(warmup)
    began = time.monotonic()
    began_wall = time.time()
    with reader.lock:
        seen = len(reader.appended)
    results: list[Minute] = []
    cost = meter.read() if meter is not None else None
    cpu = sum(sum(p.cpu_times()[:2]) for p in processes)
    queries = [scrape(h) for h in harvesters]
    rss_start = sum(p.memory_info().rss for p in processes) / 2**20
    count = int(minutes + 0.999)
    try:
        for index in range(1, count + 1):
            held = hold is not None and hold[0] <= index - 1 < hold[0] + hold[1]
            if held and old.conn is None:
                old.begin()
            elif not held and old.conn is not None:
                old.end()
            end = began + min(index * 60, seconds)
            while time.monotonic() < end:
                time.sleep(0.2)
            minute = Minute(index, held=held)
            with committed.lock, reader.lock:
                times = dict(committed.times)
                appended = dict(reader.appended)
            acked_now = len(appended)
            minute.acked = acked_now - seen
            seen = acked_now
            # Records committed in the minute ending 10 s ago (so they had time to land), none of the warm-up's.
            wall = time.time()
            minute.latencies = latencies_ms(times, appended, max(wall - 70, began_wall), wall - 10, wall)
            if index == 1 and warmup > 0:
                warm = Minute(0, latencies=latencies_ms(times, appended, warm_began, began_wall, wall))
                say(f"  warm-up, {warmup:g} s before minute 1 (in no minute nor the verdict): {len(warm.latencies):,} "
                    f"records, p50 {warm.p(50):.1f} ms, p99 {warm.p(99):.1f} ms, worst "
                    f"{max(warm.latencies, default=0.0):.1f} ms")
            minute.backlog, minute.oldest_age, minute.size_mib, minute.dead_rows = table_figures(meter_conn, table)
            if meter is not None:
                now_cost = meter.read()
                spent = now_cost - cost
                cost = now_cost
                minute.pg_cpu_us = 1e6 * spent.cpu / max(minute.acked, 1)
                minute.wal_bytes = spent.wal_bytes / max(minute.acked, 1)
            now_cpu = sum(sum(p.cpu_times()[:2]) for p in processes)
            minute.cpu_percent = 100 * (now_cpu - cpu) / 60
            cpu = now_cpu
            minute.rss_mib = sum(p.memory_info().rss for p in processes) / 2**20
            now_queries = [scrape(h) for h in harvesters]
            marks = sum(n[0] - b[0] for n, b in zip(now_queries, queries, strict=True))
            mark_s = sum(n[1] - b[1] for n, b in zip(now_queries, queries, strict=True))
            purges = sum(n[2] - b[2] for n, b in zip(now_queries, queries, strict=True))
            purge_s = sum(n[3] - b[3] for n, b in zip(now_queries, queries, strict=True))
            queries = now_queries
            minute.mark_ms = 1000 * mark_s / marks if marks else 0.0
            minute.purge_ms = 1000 * purge_s / purges if purges else 0.0
            results.append(minute)
            say(minute.line())
        say(f"  other tables at the end: {other_tables(meter_conn)}")
    finally:
        stop.set()
        old.end()
        for writer in writers:
            writer.join(timeout=60)
        reader.stopping.set()
        reader.join(timeout=30)
        meter_conn.close()
    written = len(committed.times)
    lost = written - len(set(committed.times) & set(reader.appended))
    say(f"  written {written:,}, read back {len(reader.appended):,}"
        + (f", {lost:,} not read back yet (still in the outbox or in flight at the end)" if lost else ""))
    overall = [m.p(99) for m in results if m.latencies]
    if overall:
        say(f"  p99 over the minutes: median {statistics.median(overall):.1f} ms, worst {max(overall):.1f} ms")
    return verdict(results, rate, rss_start)
