"""The harvester's SQL: mark, purge and reset, each one statement, on connections of its own.

The engine only sees the narrow `Store` protocol, so unit tests run it against an in-memory
fake. Purge and reset take many ids at once: one round trip per delivery-report batch rather
than goharvest's one per record.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

import psycopg
from psycopg import sql

log = logging.getLogger(__name__)

#: The columns the engine reads; tests check them against the Django model.
COLUMNS = ("id", "create_time", "kafka_topic", "kafka_key", "kafka_value", "kafka_header_keys",
           "kafka_header_values", "leader_id")
#: Columns beyond goharvest's that this app's migrations add; used when present.
FAILURE_COLUMNS = ("reset_count", "last_error")
CONNECT_TIMEOUT = 5


@dataclass(slots=True, eq=False)
class Record:
    """One marked outbox row, as the engine carries it from mark to purge."""

    id: int
    create_time: datetime
    topic: str
    key: str
    value: str | None
    header_keys: list[str]
    header_values: list[str]
    leader_id: uuid.UUID | None = None
    #: When this record was marked (engine clock); a queue timeout is measured from here.
    marked_at: float = field(default=0.0, compare=False)


class Store(Protocol):
    """What the engine needs from the database."""

    def mark(self, leader_id: uuid.UUID, limit: int) -> list[Record]:
        """Mark up to `limit` of the earliest rows not marked by `leader_id`; returns them sorted by id."""

    def purge(self, ids: Sequence[int]) -> int:
        """Delete delivered rows; returns how many existed. Committed when it returns."""

    def reset(self, ids: Sequence[int], errors: Sequence[str]) -> int:
        """Clear leader_id of rows whose delivery failed (errors[i] for ids[i]), so the next mark
        picks them up again; count the failure on the row when the table can."""

    def hold(self, record_id: int, error: str) -> None:
        """Note on the row that it cannot be published (a poison record held by the engine)."""

    def close(self) -> None: ...


# Mark: one atomic UPDATE ... RETURNING. The sub-select walks the primary key from its head,
# so records that committed late behind marked ones are still found (no offset is kept), and
# rows left by a dead leader look exactly like new ones: recovery needs no special case.
MARK = """
UPDATE {table} SET leader_id = %(leader_id)s
WHERE id IN (
  SELECT id FROM {table}
  WHERE leader_id IS NULL OR leader_id <> %(leader_id)s
  ORDER BY id
  LIMIT %(limit)s
)
RETURNING id, create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values, leader_id
"""

# Purge: delete delivered rows, many per statement.
PURGE = "DELETE FROM {table} WHERE id = ANY(%(ids)s)"

# Reset: put rows whose delivery failed back in scope of the next mark. Tables made by this
# app's migrations also count the failure and keep the error (reset_count, last_error).
RESET = "UPDATE {table} SET leader_id = NULL WHERE id = ANY(%(ids)s)"
RESET_COUNTED = """
UPDATE {table} AS o SET leader_id = NULL, reset_count = o.reset_count + 1, last_error = f.error
FROM unnest(%(ids)s::bigint[], %(errors)s::text[]) AS f(id, error)
WHERE o.id = f.id
"""

# Hold: a poison record stays marked (its key is held); say why on the row.
HOLD = "UPDATE {table} SET reset_count = reset_count + 1, last_error = %(error)s WHERE id = %(id)s"

# Requeue (an operator's action): put rows back in scope of the next mark, clearing their failure
# count, but never rows marked by a live leader: one of those may be in flight, and re-marking it
# behind a later record of its key would publish the two out of order.
REQUEUE = """
UPDATE {table} SET leader_id = NULL{failure_columns}
WHERE id = ANY(%(ids)s) AND (leader_id IS NULL OR NOT (leader_id = ANY(%(live)s::uuid[])))
"""


def requeue(conn: psycopg.Connection, table: str, ids: Sequence[int], live_leader_ids: Sequence[uuid.UUID],
            *, counts_failures: bool = True) -> int:
    """Requeue rows on the caller's connection (and transaction); returns how many were requeued."""
    extra = ", reset_count = 0, last_error = NULL" if counts_failures else ""
    statement = sql.SQL(REQUEUE).format(table=table_identifier(table), failure_columns=sql.SQL(extra))
    return conn.execute(statement, {"ids": list(ids), "live": list(live_leader_ids)}).rowcount


# Does the table exist, and does it have goharvest's columns?
TABLE_COLUMNS = """
SELECT attname FROM pg_attribute
WHERE attrelid = to_regclass(%(table)s) AND attnum > 0 AND NOT attisdropped
"""


def connect(dsn: str, purpose: str) -> psycopg.Connection:
    """An autocommit connection of the engine's own, named in pg_stat_activity by its purpose."""
    return psycopg.connect(dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT,
                           application_name=f"outbox-harvest-{purpose}")


def close_quietly(conn: psycopg.Connection | None) -> None:
    """Close a connection that may already be broken; the caller has given up on it."""
    if conn is not None:
        try:
            conn.close()
        except psycopg.Error:
            pass


class StoreError(Exception):
    """The outbox table cannot be used; the message is one line for the operator."""


def table_identifier(table: str) -> sql.Composable:
    """`schema.table` or `table` as a quoted SQL identifier (the name was validated by the config)."""
    return sql.Identifier(*table.split("."))


def describe_dsn(dsn: str) -> str:
    """host:port/dbname of a connection string, without the password, for error messages."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "the configured database"
    return f"{info.get('host') or 'localhost'}:{info.get('port') or 5432}/{info.get('dbname') or ''}"


class PostgresStore:
    """Store over psycopg 3. One connection marks (engine thread); another purges and resets
    (delivery thread). Both autocommit: each statement commits before it returns, which is what
    lets a purge lower its key's barrier."""

    def __init__(self, dsn: str, table: str, *, counts_failures: bool = False) -> None:
        self._dsn = dsn
        self._table = table
        self.counts_failures = counts_failures
        ident = table_identifier(table)
        self._mark_sql = sql.SQL(MARK).format(table=ident)
        self._purge_sql = sql.SQL(PURGE).format(table=ident)
        self._reset_sql = sql.SQL(RESET_COUNTED if counts_failures else RESET).format(table=ident)
        self._hold_sql = sql.SQL(HOLD).format(table=ident)
        self._mark_conn: psycopg.Connection | None = None
        self._ack_conn: psycopg.Connection | None = None
        self._ack_lock = threading.Lock()

    @classmethod
    def open(cls, dsn: str, table: str) -> PostgresStore:
        """Connect and check the table; raises StoreError with a one-line reason."""
        store = cls(dsn, table)
        try:
            conn = store._mark_connection()
            columns = {name for (name,) in conn.execute(TABLE_COLUMNS, {"table": table_name(table)})}
        except psycopg.OperationalError as error:
            store.close()
            raise StoreError(f"cannot connect to Postgres at {describe_dsn(dsn)}: {first_line(error)}") from None
        except psycopg.Error as error:
            store.close()
            raise StoreError(f"cannot read table {table!r} at {describe_dsn(dsn)}: {first_line(error)}") from None
        if not columns:
            store.close()
            raise StoreError(f"table {table!r} does not exist at {describe_dsn(dsn)} (run manage.py migrate)")
        missing = [c for c in COLUMNS if c not in columns]
        if missing:
            store.close()
            raise StoreError(f"table {table!r} lacks the outbox column(s) {', '.join(missing)}")
        if all(c in columns for c in FAILURE_COLUMNS):
            conn, store._mark_conn = store._mark_conn, None
            store.close()
            store = cls(dsn, table, counts_failures=True)
            store._mark_conn = conn
        return store

    def _mark_connection(self) -> psycopg.Connection:
        if self._mark_conn is None or self._mark_conn.closed:
            self._mark_conn = connect(self._dsn, "mark")
        return self._mark_conn

    def _ack_connection(self) -> psycopg.Connection:
        if self._ack_conn is None or self._ack_conn.closed:
            self._ack_conn = connect(self._dsn, "purge")
        return self._ack_conn

    def mark(self, leader_id: uuid.UUID, limit: int) -> list[Record]:
        try:
            rows = self._mark_connection().execute(self._mark_sql, {"leader_id": leader_id, "limit": limit},
                                                   prepare=True).fetchall()
        except psycopg.Error:
            self._drop("_mark_conn")
            raise
        records = [Record(*row) for row in rows]
        # RETURNING yields rows in no particular order; per-key order depends on this sort.
        records.sort(key=lambda r: r.id)
        return records

    def purge(self, ids: Sequence[int]) -> int:
        return self._ack(self._purge_sql, ids)

    def reset(self, ids: Sequence[int], errors: Sequence[str]) -> int:
        return self._ack(self._reset_sql, {"ids": list(ids), "errors": list(errors)})

    def hold(self, record_id: int, error: str) -> None:
        if self.counts_failures:
            self._ack(self._hold_sql, {"id": record_id, "error": error})

    def _ack(self, statement: sql.Composed, params: dict[str, object] | Sequence[int]) -> int:
        if not isinstance(params, dict):
            params = {"ids": list(params)}
        with self._ack_lock:
            try:
                return self._ack_connection().execute(statement, params, prepare=True).rowcount
            except psycopg.Error:
                self._drop("_ack_conn")
                raise

    def _drop(self, attribute: str) -> None:
        """Forget a connection after an error; the next call reconnects."""
        conn = getattr(self, attribute)
        setattr(self, attribute, None)
        close_quietly(conn)

    def close(self) -> None:
        self._drop("_mark_conn")
        with self._ack_lock:
            self._drop("_ack_conn")


class Listener:
    """LISTENs for stash()'s NOTIFY on its own connection, so a committed record wakes the leader."""

    def __init__(self, dsn: str, channel: str) -> None:
        self._dsn = dsn
        self._channel = channel
        self._conn: psycopg.Connection | None = None

    def fileno(self) -> int | None:
        """The socket to select on, or None while disconnected (the engine then just polls)."""
        if self._conn is None or self._conn.closed:
            try:
                self._conn = connect(self._dsn, "listen")
                self._conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
            except psycopg.Error as error:
                log.debug("LISTEN unavailable, polling only: %s", first_line(error))
                self.close()
                return None
        return self._conn.fileno()

    def drain(self) -> int:
        """Consume pending notifications; returns how many arrived."""
        if self._conn is None:
            return 0
        try:
            return sum(1 for _ in self._conn.notifies(timeout=0))
        except psycopg.Error:
            self.close()
            return 0

    def close(self) -> None:
        conn, self._conn = self._conn, None
        close_quietly(conn)


def table_name(table: str) -> str:
    """The table as to_regclass() wants it: each part quoted, so case is kept."""
    return ".".join('"' + part.replace('"', '""') + '"' for part in table.split("."))


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
