"""Runs the engine's SQL (contract.py) on connections of its own, psycopg 3, autocommit.

Two sessions, used from two threads:
- the *fence session* takes the table's advisory lock and runs every mark (and the held-row
  reads and parking): a leader that lost the fence can therefore mark nothing;
- the *purge session* purges, resets and holds, so settling never waits behind a mark.
Every statement commits before it returns, which is what lets a purge free its key's slot. A purge
the engine does not need on disk (cmd.Purge.durable) commits asynchronously (contract.PURGE_COMMIT):
visible at once, flushed by the WAL writer or the next commit that waits.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg import sql

from outbox.harvest import contract, sharding
from outbox.harvest.contract import Record
from outbox.kafka.redaction import dsn_problem
from outbox.reasons import first_line

log = logging.getLogger(__name__)

_T = TypeVar("_T")

CONNECT_TIMEOUT = 5
#: application_name prefix of the engine's sessions (seen in pg_stat_activity, and by the fence).
APPLICATION_PREFIX = "outbox-harvest"


#: The replica status table as the migrations name it; its presence says the schema was applied (schema.py).
STATUS_TABLE = "outbox_harvester"
#: How the missing tables are made: by Django's migrations, or the stand-alone harvester's DDL (schema.py).
MIGRATE_HINT = ("run manage.py migrate, or outbox-harvest schema --apply (with --since on a database that has part "
                "of it)")


def how_made(table: str, made: str) -> str:
    """How a missing table the harvester uses gets made, for a log line: `made` is the name the migrations (and
    `outbox-harvest schema --apply`) give it, `table` the name the settings do."""
    if table.rpartition(".")[2] == made:
        return "manage.py migrate, or outbox-harvest schema --apply, creates it"
    return (f"manage.py migrate and outbox-harvest schema --apply create {made}, not {table}: leave status_table "
            f"unset, or make {table} as they make {made} (outbox-harvest schema prints how)")


class StoreError(Exception):
    """The outbox table cannot be used; the message is one line for the operator."""


#: The oldest Postgres the engine runs on (server_version_num); README, "Using it in your project", says
#: so, and tests/integration/test_postgres_majors.py runs the harvester on it.
MIN_SERVER_VERSION = 140000


def connect(dsn: str, purpose: str, *, name: str = "", generic_plans: bool = False,
            **params: str) -> psycopg.Connection:
    """An autocommit connection of the engine's own, named in pg_stat_activity by purpose (and replica);
    `params` adds libpq parameters (e.g. keepalives).

    `generic_plans`: its prepared statements are planned once, not at every execution (the fence and
    purge sessions: planning a mark anew cost the server more than running it; docs/benchmarks.md), and
    read the outbox by index. A plan made once must not depend on the table's size when it was made:
    planned on an empty table, a mark would scan and sort the whole table until autovacuum next
    analyzed it, however many rows (or dead rows) it had by then. Every statement on these sessions is a
    lookup by primary key (or a shard's index)."""
    application = f"{APPLICATION_PREFIX}-{purpose}" + (f" {name}" if name else "")
    conn = psycopg.connect(dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT, application_name=application[:63],
                           **params)
    # The engine's statements are short lookups whose cost estimates can pass jit_above_cost (a shard's gaps,
    # estimated over the whole shard): compiling them would cost more than running them.
    conn.execute("SET jit = off; SET plan_cache_mode = force_generic_plan; SET enable_seqscan = off" if generic_plans
                 else "SET jit = off")
    return conn


def group_tag(group: str) -> str:
    """A short, fixed-length tag of a leader group, carried in the fence session's application_name."""
    return hashlib.sha1(group.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class FenceHolder:
    """The session holding a table's fence, as Postgres shows it."""

    pid: int
    name: str
    group: str  # the group's name if its status row says so, else its tag
    host: str
    same_group: bool

    def __str__(self) -> str:
        return f"replica {self.name} of leader group {self.group} on {self.host} (database session {self.pid})"


def close_quietly(conn: psycopg.Connection | None) -> None:
    """Close a connection that may already be broken; the caller has given up on it."""
    if conn is not None:
        try:
            conn.close()
        except psycopg.Error:
            pass


def table_identifier(table: str) -> sql.Composable:
    """`schema.table` or `table` as a quoted SQL identifier (the name was validated by the config)."""
    return sql.Identifier(*table.split("."))


def shard_terms_table(status_table: str) -> str:
    """The table of shard terms beside a status table: `outbox_harvester` -> `outbox_harvester_shards`."""
    return f"{status_table}_shards"


def table_name(table: str) -> str:
    """The table as to_regclass() wants it: each part quoted, so case is kept."""
    return ".".join('"' + part.replace('"', '""') + '"' for part in table.split("."))


def describe_dsn(dsn: str) -> str:
    """host:port/dbname of a connection string, without the password, for error messages."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "the configured database"
    return f"{info.get('host') or 'localhost'}:{info.get('port') or 5432}/{info.get('dbname') or ''}"



def requeue(conn: psycopg.Connection, table: str, ids: Sequence[int]) -> int:
    """Clear rows' failure counts on the caller's connection (and transaction); returns how many."""
    statement = sql.SQL(contract.REQUEUE).format(table=table_identifier(table))
    return conn.execute(statement, {"ids": list(ids)}).rowcount


def _record(row: Sequence[Any]) -> Record:
    return Record(*row)


class PostgresStore:
    """The engine's database side; see the module docstring for its two sessions."""

    def __init__(self, dsn: str, table: str, *, name: str = "", group: str = "", counts_failures: bool = False,
                 table_oid: int = 0, dead_letter_table: str | None = None, status_table: str | None = None,
                 shards: int = 1, shard: int = 0) -> None:
        self._dsn = dsn
        self._table = table
        self._name = name
        self._group = group
        self._status_table = status_table
        self.counts_failures = counts_failures
        self.table_oid = table_oid
        #: The table is partitioned by id range: the leader keeps its partitions (partitions.py).
        self.partitioned = False
        #: The schema the table is in, as the session's search_path found it (an unqualified table's may be any).
        self.schema = "public"
        self.dead_letter_table = dead_letter_table
        ident = table_identifier(table)
        #: This store's shard of the table (sharding.py): its marks read only that shard's rows.
        self.shards, self.shard = shards, shard
        self._mark_sql = sql.SQL(contract.MARK).format(table=ident, above=sql.SQL(contract.mark_above(shards)))
        self._gaps_sql = sql.SQL(contract.GAPS if shards <= 1 else contract.shard_gaps(shards)).format(table=ident)
        self._purge_sql = sql.SQL(contract.PURGE).format(table=ident)
        self._purge_unfenced_sql = sql.SQL(contract.PURGE_UNFENCED).format(table=ident)
        self._reset_sql = sql.SQL(contract.RESET_COUNTED if counts_failures else contract.RESET).format(table=ident)
        self._hold_sql = sql.SQL(contract.HOLD_COUNTED if counts_failures else contract.HOLD).format(table=ident)
        self._check_sql = sql.SQL(contract.CHECK_HELD).format(table=ident)
        self._park_sql = (sql.SQL(contract.PARK).format(table=ident,
                                                        dead_letters=table_identifier(dead_letter_table))
                          if dead_letter_table else None)
        #: With shards: the table of shard terms (contract.CLAIM_SHARD), and, after a take_fence() that took
        #: the fence, the previous leader of the shard if it did not settle (None: it did, or there was none).
        self._terms_sql = (tuple(sql.SQL(text).format(terms=table_identifier(shard_terms_table(status_table)))
                                 for text in (contract.CLAIM_SHARD, contract.SETTLE_SHARD))
                           if shards > 1 and status_table else None)
        self.unsettled_predecessor: str | None = None
        self._incarnation = uuid.uuid4().hex[:8]  # this store's sessions, one after another: its own terms
        self._holder = ""
        self._fence_conn: psycopg.Connection | None = None
        self._fence_held = False
        #: The fence session's backend pid while it holds the fence (read by the purge session's checks).
        self.fence_pid = 0
        self._purge_conn: psycopg.Connection | None = None
        self._purge_lock = threading.Lock()

    @classmethod
    def open(cls, dsn: str, table: str, *, name: str = "", group: str = "", dead_letter_table: str | None = None,
             status_table: str | None = None, shards: int = 1, shard: int = 0) -> PostgresStore:
        """Connect and check the table; raises StoreError with a one-line reason."""
        where = describe_dsn(dsn)
        try:
            conn = connect(dsn, "fence", name=f"{group_tag(group)} {name}", generic_plans=True)
        except psycopg.OperationalError as error:
            raise StoreError(f"cannot connect to Postgres at {where}: {first_line(error)}") from None
        except psycopg.ProgrammingError:  # libpq cannot parse it; its words could quote part of a password
            raise StoreError(f"cannot connect to Postgres: dsn {dsn_problem(dsn)}") from None
        if conn.info.server_version < MIN_SERVER_VERSION:
            version = conn.info.server_version
            close_quietly(conn)
            raise StoreError(f"Postgres at {where} is {version // 10000}.{version % 10000}: the oldest supported "
                             f"is {MIN_SERVER_VERSION // 10000}")
        try:
            columns = {name for (name,) in conn.execute(contract.TABLE_COLUMNS, {"table": table_name(table)})}
            oid = conn.execute(contract.TABLE_OID, {"table": table_name(table)}).fetchone()[0]
            dead_letters = None
            if dead_letter_table and conn.execute(contract.TABLE_OID, {"table": table_name(dead_letter_table)}
                                                  ).fetchone()[0] is not None:
                dead_letters = dead_letter_table
        except psycopg.Error as error:
            close_quietly(conn)
            raise StoreError(f"cannot read table {table!r} at {where}: {first_line(error)}") from None
        if not columns:
            close_quietly(conn)
            raise StoreError(f"table {table!r} does not exist at {where} ({MIGRATE_HINT})")
        missing = [c for c in contract.COLUMNS if c not in columns]
        if missing:
            close_quietly(conn)
            raise StoreError(f"table {table!r} lacks the outbox column(s) {', '.join(missing)}")
        try:
            partitioned = bool(conn.execute(
                "SELECT EXISTS (SELECT 1 FROM pg_partitioned_table WHERE partrelid = %s)", [oid]).fetchone()[0])
            schema = conn.execute(contract.TABLE_SCHEMA, {"oid": oid}).fetchone()[0]
        except psycopg.Error as error:
            close_quietly(conn)
            raise StoreError(f"cannot read table {table!r} at {where}: {first_line(error)}") from None
        store = cls(dsn, table, name=name, group=group,
                    counts_failures=all(c in columns for c in contract.FAILURE_COLUMNS), table_oid=int(oid),
                    dead_letter_table=dead_letters, status_table=status_table, shards=shards, shard=shard)
        store.partitioned, store.schema = partitioned, schema
        store._fence_conn = conn
        return store

    def has_notify_trigger(self) -> bool:
        """Whether the table's trigger NOTIFYs its channel on every insert (migration 0003 installs it)."""
        row = self._fence_connection().execute(
            "SELECT EXISTS (SELECT 1 FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid "
            "WHERE t.tgrelid = %s AND p.proname = 'outbox_notify' AND NOT t.tgisinternal)", [self.table_oid],
        ).fetchone()
        return bool(row[0])

    # -- the fence session (one thread) -----------------------------------------------------------

    def _fence_connection(self) -> psycopg.Connection:
        if self._fence_conn is None or self._fence_conn.closed:
            self._fence_held = False  # a new session holds no lock
            self._fence_conn = connect(self._dsn, "fence", name=f"{group_tag(self._group)} {self._name}",
                                       generic_plans=True)
        return self._fence_conn

    @property
    def _fence_class(self) -> int:
        return sharding.shard_class(self.shards, self.shard) if self.shards > 1 else contract.FENCE_CLASS

    def take_fence(self, *, end_stale: bool = True) -> FenceHolder | None:
        """Take the table's fence (with shards: this shard's) on the fence session; None when taken,
        else who holds it.

        A holder of our own group is a stale leader (Kafka gave the group's leadership to this
        replica): with `end_stale` its session is ended, after which none of its statements can
        succeed, and the fence is taken. Without it (a shard handed over by a rebalance, whose old
        leader settles what it has in flight before it lets the fence go) the holder is returned.
        """
        self.unsettled_predecessor = None
        try:
            conn = self._fence_connection()
            if self._fence_held:
                return None
            params = {"key": sharding.lock_key(self._fence_class, self.table_oid), "class": self._fence_class,
                      "table_oid": self.table_oid}
            holder: FenceHolder | None = None
            for _ in range(3):
                if conn.execute(contract.TAKE_FENCE, params).fetchone()[0]:
                    other = self._take_shared_fences(conn) if self.shards > 1 else None
                    if other is None:
                        self._fence_held = True
                        self.fence_pid = conn.info.backend_pid
                        self.unsettled_predecessor = self._claim_shard(conn) if self.shards > 1 else None
                        return None
                    conn.execute(contract.RELEASE_FENCE, params)
                    return other
                row = conn.execute(contract.FENCE_HOLDER, params).fetchone()
                if row is None:
                    continue  # released in between: try again
                holder = self._describe_holder(conn, *row)
                if not holder.same_group or not end_stale:
                    return holder
                log.warning("Ending the database session of a stale leader of this group: %s", holder)
                conn.execute(contract.TERMINATE, {"pid": holder.pid})
            return holder
        except psycopg.Error:
            self._drop_fence()
            raise

    def _claim_shard(self, conn: psycopg.Connection) -> str | None:
        """Claim the shard's term row; the previous leader if it did not settle. Without the table, every
        predecessor is taken as unsettled (the sharded harvester checks the table is there before it starts)."""
        own = f"{self._name} ({self._incarnation},"
        self._holder = f"{own} session {conn.info.backend_pid})"
        if self._terms_sql is None:
            return "an unknown leader (no table of shard terms)"
        settled, holder, _ = conn.execute(self._terms_sql[0], {
            "table_oid": self.table_oid, "shards": self.shards, "shard": self.shard, "holder": self._holder,
        }).fetchone()
        # This store's own earlier session (lost, say, with a dropped connection) settled before this term began.
        return holder if settled is False and not holder.startswith(own) else None

    def _take_shared_fences(self, conn: psycopg.Connection) -> FenceHolder | None:
        """A shard's leader also holds, shared, the table's unsharded fence and its N's key (sharding.py);
        None when both are held and no leader of another N holds its own, else who is in the way
        (and nothing of the two is kept)."""
        table = {"key": sharding.lock_key(contract.FENCE_CLASS, self.table_oid), "class": contract.FENCE_CLASS,
                 "table_oid": self.table_oid}
        count = {"key": sharding.lock_key(sharding.shard_count_class(self.shards), self.table_oid)}
        if not conn.execute(contract.TAKE_SHARED_FENCE, table).fetchone()[0]:
            row = conn.execute(contract.FENCE_HOLDER, table).fetchone()
            return self._describe_holder(conn, *row) if row else FenceHolder(0, "an unsharded leader", "?", "?",
                                                                             same_group=False)
        conn.execute(contract.TAKE_SHARED_FENCE, count)
        row = conn.execute(contract.OTHER_SHARD_COUNT, {
            "table_oid": self.table_oid, "lo": sharding.SHARD_COUNT_CLASS_BASE,
            "hi": sharding.SHARD_COUNT_CLASS_BASE + sharding.MAX_SHARDS,
            "mine": sharding.shard_count_class(self.shards)}).fetchone()
        if row is None:
            return None
        conn.execute(contract.RELEASE_SHARED_FENCE, count)
        conn.execute(contract.RELEASE_SHARED_FENCE, table)
        holder = self._describe_holder(conn, *row[:3])
        return FenceHolder(holder.pid, f"{holder.name} (sharded {row[3]} ways)", holder.group, holder.host,
                           same_group=False)

    def _describe_holder(self, conn: psycopg.Connection, pid: int, application: str, address: str) -> FenceHolder:
        # application_name is "outbox-harvest-fence <group tag> <name>" (see connect()).
        _, _, rest = application.partition(" ")
        tag, _, name = rest.partition(" ")
        group, host = tag, address
        if self._status_table:
            try:
                row = conn.execute(sql.SQL("SELECT leader_group, host FROM {} WHERE name = %s").format(
                    table_identifier(self._status_table)), [name]).fetchone()
            except psycopg.Error:
                row = None
            if row is not None:
                group, host = row[0], row[1]
        return FenceHolder(pid, name or application, group, host, same_group=tag == group_tag(self._group))

    def release_fence(self, *, settled: bool = True) -> None:
        """Let the fence go; `settled`: nothing this leader sent is in flight, which a shard's term row says
        first (so its successor need not wait for stragglers)."""
        if self._fence_conn is None or not self._fence_held:
            return
        try:
            if settled and self._terms_sql is not None:
                self._fence_conn.execute(self._terms_sql[1], {"table_oid": self.table_oid, "shards": self.shards,
                                                              "shard": self.shard, "holder": self._holder})
            self._fence_conn.execute(contract.RELEASE_FENCE,
                                     {"key": sharding.lock_key(self._fence_class, self.table_oid)})
            if self.shards > 1:
                for lock_class in (contract.FENCE_CLASS, sharding.shard_count_class(self.shards)):
                    self._fence_conn.execute(contract.RELEASE_SHARED_FENCE,
                                             {"key": sharding.lock_key(lock_class, self.table_oid)})
        except psycopg.Error:
            self._drop_fence()
        self._fence_held = False
        self.fence_pid = 0

    def mark(self, limit: int, after: int,
             gaps: Sequence[tuple[int, int]] = ()) -> tuple[list[Record], frozenset[str] | None]:
        """Read the rows a term takes next (contract.MARK, and GAPS when there are gaps), sorted by id,
        and the outbox's writers seen just before (contract.WRITERS), in one round trip. Needs the fence.

        The writers are read only with gaps to look up (None otherwise): they only ever watch or forget
        gaps the mark looks up (marking.py), and a pg_locks read costs the server a scan of its lock
        table, on every wake of a steady writer."""
        try:
            conn = self._fence_connection()
            if not self._fence_held:
                raise psycopg.OperationalError("the database fence was lost with its session")
            with conn.pipeline():
                writers = conn.execute(contract.WRITERS, {"table_oid": self.table_oid}, prepare=True) if gaps else None
                cursor = conn.execute(self._mark_sql, {"limit": limit, "after": after, "shard": self.shard},
                                      prepare=True)
                found = conn.execute(self._gaps_sql, {"los": [lo for lo, _ in gaps], "his": [hi for _, hi in gaps],
                                                      "limit": limit, "shard": self.shard},
                                     prepare=True) if gaps else None
            running = frozenset(row[0] for row in writers.fetchall()) if writers is not None else None
            rows = cursor.fetchall()
            if found is not None:
                rows.extend(found.fetchall())
        except psycopg.Error:
            self._drop_fence()
            raise
        records = [Record(*row) for row in rows]
        # Per-key order depends on this sort (gap rows come back with the others).
        records.sort(key=lambda r: r.id)
        return records, running

    def check_held(self, ids: Sequence[int]) -> dict[int, Record]:
        try:
            rows = self._fence_connection().execute(self._check_sql, {"ids": list(ids)}).fetchall()
        except psycopg.Error:
            self._drop_fence()
            raise
        return {row[0]: Record(*row) for row in rows}

    def park(self, record: Record, reason: str, attempts: int, parked_by: str, dead_letter_topic: str | None) -> bool:
        """Move a held row to the dead-letter table; False if it was not there (or not ours) any more."""
        if self._park_sql is None:
            raise StoreError(f"no dead-letter table ({MIGRATE_HINT})")
        try:
            row = self._fence_connection().execute(self._park_sql, {
                "id": record.id, "version": record.version, "reason": reason, "attempts": attempts,
                "parked_by": parked_by, "dead_letter_topic": dead_letter_topic}).fetchone()
        except psycopg.Error:
            self._drop_fence()
            raise
        return row is not None

    def _drop_fence(self) -> None:
        conn, self._fence_conn = self._fence_conn, None
        self._fence_held = False
        self.fence_pid = 0
        close_quietly(conn)

    # -- the purge session (another thread) -------------------------------------------------------

    def _purge_connection(self) -> psycopg.Connection:
        if self._purge_conn is None or self._purge_conn.closed:
            self._purge_conn = connect(self._dsn, "purge", name=self._name, generic_plans=True)
        return self._purge_conn

    def purge(self, ids: Sequence[int], read_fence: bool = True, durable: bool = True) -> tuple[int, bool]:
        """Delete rows whose records Kafka acknowledged: (how many went, whether this replica's fence
        session still holds the fence; True without `read_fence`). Without `durable` it commits
        asynchronously."""
        return self._settle(self._purge_sql if read_fence else self._purge_unfenced_sql,
                            {"ids": list(ids), "durable": durable})

    def reset(self, ids: Sequence[int], errors: Sequence[str]) -> tuple[int, bool]:
        """Rows whose delivery failed: count the failure when the table can (same answer as purge)."""
        return self._settle(self._reset_sql, {"ids": list(ids), "errors": list(errors)})

    def hold(self, record_id: int, reason: str) -> int | None:
        """Note on a poison row why it is held; returns its version after that (None: the row is gone)."""
        row = self._on_purge_session(self._hold_sql, {"id": record_id, "error": reason}, lambda c: c.fetchone())
        return row[0] if row else None

    def _settle(self, statement: sql.Composed, params: dict[str, Any]) -> tuple[int, bool]:
        params.update({"class": self._fence_class, "table_oid": self.table_oid, "fence_pid": self.fence_pid})
        # (fence held, rows): an unfenced purge answers True; a purge's third column is its commit's setting.
        row = self._on_purge_session(statement, params, lambda c: c.fetchone(), prepare=True)
        return row[1], row[0]

    def _on_purge_session(self, statement: sql.Composed, params: dict[str, Any],
                          answer: Callable[[psycopg.Cursor[Any]], _T], prepare: bool = False) -> _T:
        """Run one statement on the purge session and read its answer, under the purge lock; a session
        that failed is dropped (the next statement opens another)."""
        with self._purge_lock:
            try:
                return answer(self._purge_connection().execute(statement, params, prepare=prepare))
            except psycopg.Error:
                self._drop_purge()
                raise

    def _drop_purge(self) -> None:
        conn, self._purge_conn = self._purge_conn, None
        close_quietly(conn)

    def close(self) -> None:
        self._drop_fence()
        with self._purge_lock:
            self._drop_purge()
