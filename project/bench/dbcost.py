"""What a stretch of work costs the Postgres server: CPU of all its processes, WAL written, and the
time, calls and rows of each kind of statement (pg_stat_statements).

    meter = ServerMeter(connection)
    before = meter.read()
    ...                                  # the work
    cost = meter.read() - before         # Cost: cpu, wal_bytes, statements

CPU is the server's own processes (postmaster, backends, autovacuum, checkpointer, walwriter...),
found from the postmaster's pid: live children's CPU time plus what the postmaster reaped from
children that exited (backends of closed connections), so nothing that ran meanwhile is missed.
It needs the server on this machine (the project's own, or testcontainers' would not do).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import psutil
import psycopg

#: Statements are grouped by what they do to which table (or what they read), whatever their parameters.
_KINDS = (
    (re.compile(r"^\s*(with\b.*?\))?\s*insert\s+into\s+\"?(\w+)", re.I | re.S), "INSERT {}"),
    (re.compile(r"\bdelete\s+from\s+\"?(\w+)", re.I), "DELETE {}"),
    (re.compile(r"^\s*update\s+\"?(\w+)", re.I), "UPDATE {}"),
    (re.compile(r"\bupdate\s+\"?(\w+)", re.I), "UPDATE {}"),
    (re.compile(r"pg_current_snapshot", re.I), "snapshot"),
    (re.compile(r"pg_try_advisory_lock|pg_advisory_unlock", re.I), "fence"),
    (re.compile(r"^\s*select\b.*?\bfrom\s+\"?(\w+)", re.I | re.S), "SELECT {}"),
)


def kind_of(query: str) -> str:
    if "/* bench */" in query or "pg_stat_statements" in query:
        return "(the benchmark's own)"
    for pattern, label in _KINDS:
        found = pattern.search(query)
        if found:
            groups = [g for g in found.groups() if g and not g.lower().startswith("with")]
            return label.format(groups[-1] if groups else "")
    return query.split(None, 1)[0].upper() if query.strip() else "?"


@dataclass
class Statements:
    """Per kind: (calls, rows, total execution ms)."""

    kinds: dict[str, tuple[int, int, float]] = field(default_factory=dict)

    def __sub__(self, other: Statements) -> Statements:
        found = {}
        for kind, (calls, rows, ms) in self.kinds.items():
            before = other.kinds.get(kind, (0, 0, 0.0))
            delta = (calls - before[0], rows - before[1], ms - before[2])
            if delta[0] > 0 and not kind.startswith("("):
                found[kind] = delta
        return Statements(found)


@dataclass
class Cost:
    cpu: float  # seconds of CPU, all server processes
    wal_bytes: int
    statements: Statements
    dead_tuples: int = 0

    def __sub__(self, other: Cost) -> Cost:
        return Cost(self.cpu - other.cpu, self.wal_bytes - other.wal_bytes, self.statements - other.statements,
                    self.dead_tuples - other.dead_tuples)

    def lines(self, records: int, indent: str = "    ") -> list[str]:
        """The statements, most expensive first, per record."""
        out = []
        for kind, (calls, rows, ms) in sorted(self.statements.kinds.items(), key=lambda item: -item[1][2]):
            out.append(f"{indent}{kind:<28} {calls:>9,} calls {rows:>10,} rows {ms:>9,.0f} ms"
                       f"  ({1000 * ms / max(records, 1):.2f} us/record)")
        return out


class ServerMeter:
    """Reads the server's cumulative CPU, WAL position and statement counters, on its own connection."""

    def __init__(self, conn: Any, table: str = "outbox") -> None:
        self.conn = conn
        self.table = table
        with conn.cursor() as cursor:
            cursor.execute("SELECT pid FROM pg_stat_activity WHERE backend_type = 'checkpointer'")
            row = cursor.fetchone()
        if row is None:
            raise RuntimeError("cannot see the server's processes (pg_stat_activity shows no checkpointer)")
        try:
            self.postmaster = psutil.Process(row[0]).parent()
        except psutil.Error as error:
            raise RuntimeError(f"the database server is not on this machine: {error}") from None
        with conn.cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_extension WHERE extname = 'pg_stat_statements'")
            self.has_statements = cursor.fetchone() is not None
        #: Why the statements' figures are missing, said once by whoever reports them (None: they are there).
        self.without_statements: str | None = None if self.has_statements else (
            "no pg_stat_statements in this database (CREATE EXTENSION pg_stat_statements)")
        if self.has_statements:
            try:
                with conn.transaction(), conn.cursor() as cursor:  # a failure here leaves the session usable
                    cursor.execute("SELECT 1 FROM pg_stat_statements LIMIT 1")
            except psycopg.errors.ObjectNotInPrerequisiteState:  # created, but not in shared_preload_libraries
                self.has_statements = False
                self.without_statements = "pg_stat_statements is not loaded (shared_preload_libraries)"

    def cpu(self) -> float:
        """CPU seconds of every server process so far. A backend that exits while this reads would be
        counted twice (alive, then reaped) or not at all: read again until none did."""
        for _ in range(20):
            children = self.postmaster.children()
            alive = 0.0
            for child in children:
                try:
                    times = child.cpu_times()
                except psutil.Error:
                    break
                alive += times.user + times.system
            else:
                own = self.postmaster.cpu_times()
                if all(child.is_running() for child in children):
                    return own.user + own.system + own.children_user + own.children_system + alive
            time.sleep(0.01)
        raise RuntimeError("the server's processes kept changing while their CPU time was read")

    def sessions(self, prefix: str) -> dict[int, tuple[str, float]]:
        """CPU seconds so far of each live backend whose application_name starts with `prefix`, by pid
        (with its application_name): what the harvester's own sessions cost, apart from the server's
        other processes (the writers' backends, autovacuum, the WAL writer)."""
        with self.conn.cursor() as cursor:
            cursor.execute("SELECT pid, application_name FROM pg_stat_activity WHERE application_name LIKE %s",
                           [prefix + "%"])
            found = cursor.fetchall()
        spent = {}
        for pid, application in found:
            try:
                times = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            spent[pid] = (application, times.user + times.system)
        return spent

    def statements(self) -> Statements:
        if not self.has_statements:
            return Statements()
        kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
        with self.conn.cursor() as cursor:
            cursor.execute("SELECT query, calls, rows, total_exec_time FROM pg_stat_statements "
                           "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())")
            for query, calls, rows, ms in cursor.fetchall():
                total = kinds[kind_of(query)]
                total[0] += calls
                total[1] += rows
                total[2] += ms
        return Statements({kind: (int(c), int(r), float(m)) for kind, (c, r, m) in kinds.items()})

    def read(self) -> Cost:
        statements = self.statements()
        with self.conn.cursor() as cursor:
            cursor.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint")
            wal = cursor.fetchone()[0]
            cursor.execute("SELECT coalesce(n_dead_tup, 0) FROM pg_stat_user_tables WHERE relname = %s",
                           [self.table])
            row = cursor.fetchone()
        return Cost(self.cpu(), int(wal), statements, int(row[0]) if row else 0)


def session_cpu(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds between two ServerMeter.sessions() reads, by the session's purpose (its application_name's
    word after the prefix: fence, purge, listen, status), most first. A session opened between the reads
    counts from zero; one closed between them is not seen."""
    spent: dict[str, float] = defaultdict(float)
    for pid, (application, cpu) in after.items():
        purpose = application.split(" ")[0].rsplit("-", 1)[-1]
        spent[purpose] += cpu - before.get(pid, (application, 0.0))[1]
    return dict(sorted(spent.items(), key=lambda item: -item[1]))
