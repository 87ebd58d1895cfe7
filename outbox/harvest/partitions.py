"""The partitioned outbox (opt in): the table partitioned by id range, kept by the leading harvester.

Deleting every published row leaves dead rows that only vacuum removes, and nothing can remove
them while something holds the database's horizon back (docs/operations.md, "The horizon alarm").
Partitioned by id range, the outbox sheds them another way: once a partition below the one being
written holds no live row, the leader truncates it (its dead rows go with its files, whatever holds
the horizon) and drops it. Writers (stash() and plain SQL alike) insert into the parent, as before;
marks, gap lookups and purges run on the parent too.

`manage.py outbox_partition` converts the table (convert()); the leader keeps it (keep()): partitions
created `AHEAD` ahead of the id sequence, a DEFAULT partition as a safety net for ids beyond them,
drained partitions truncated and dropped. Every lock it takes is tried with a short lock_timeout,
so it never keeps a writer or the harvester waiting: what it could not do now it does next time.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import psycopg
from psycopg import sql

from outbox.harvest.store import table_identifier, table_name
from outbox.reasons import first_line

log = logging.getLogger("outbox.harvest.partitions")

#: Partitions kept ahead of the id sequence (each `size` ids wide).
AHEAD = 2
#: How long a partition's maintenance waits for a lock before it leaves that partition for next time.
LOCK_TIMEOUT = "50ms"
#: The leader looks at its partitions this often (seconds).
KEEP_INTERVAL = 10.0

PARTITIONED = "SELECT EXISTS (SELECT 1 FROM pg_partitioned_table WHERE partrelid = to_regclass(%(table)s))"
PARTITIONS = """
SELECT c.relname, pg_get_expr(c.relpartbound, c.oid), c.oid::regclass::text
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass(%(table)s)
"""
# The last id taken; before the first (just converted), one below where the sequence starts.
LAST_ID = """
SELECT coalesce(pg_sequence_last_value(s), (SELECT seqstart - 1 FROM pg_sequence WHERE seqrelid = s))
FROM CAST(pg_get_serial_sequence(%(table)s, 'id') AS regclass) AS s
"""
_BOUNDS = re.compile(r"FOR VALUES FROM \('?(-?\d+|MINVALUE)'?\) TO \('?(-?\d+|MAXVALUE)'?\)")

# Storage parameters of every partition: as the unpartitioned table's (docs/tuning.md, "Autovacuum").
STORAGE = ("fillfactor = 70, autovacuum_vacuum_scale_factor = 0.0, autovacuum_vacuum_threshold = 5000, "
           "autovacuum_vacuum_insert_scale_factor = 0.0, autovacuum_vacuum_insert_threshold = 20000, "
           "autovacuum_analyze_scale_factor = 0.0, autovacuum_analyze_threshold = 20000, "
           "autovacuum_vacuum_cost_delay = 0")


class PartitionError(Exception):
    """The table cannot be partitioned as asked; one line for the operator."""


@dataclass(frozen=True)
class Partition:
    name: str  # as regclass text, schema-qualified where needed
    lo: int | None  # None: MINVALUE
    hi: int | None  # None: MAXVALUE
    default: bool = False


def partitions(conn: psycopg.Connection, table: str) -> list[Partition]:
    """The table's partitions, range partitions by their lower bound, the DEFAULT one last."""
    found, default = [], []
    for _relname, bound, regclass in conn.execute(PARTITIONS, {"table": table_name(table)}).fetchall():
        if bound == "DEFAULT":
            default.append(Partition(regclass, None, None, default=True))
            continue
        match = _BOUNDS.search(bound or "")
        if match is None:
            continue
        lo, hi = match.groups()
        found.append(Partition(regclass, None if lo == "MINVALUE" else int(lo), None if hi == "MAXVALUE" else int(hi)))
    found.sort(key=lambda p: -(2**63) if p.lo is None else p.lo)
    return found + default


def _schema(schema: str) -> list[str]:
    return [schema] if schema else []


def is_partitioned(conn: psycopg.Connection, table: str) -> bool:
    return bool(conn.execute(PARTITIONED, {"table": table_name(table)}).fetchone()[0])


def convert(conn: psycopg.Connection, table: str, size: int) -> list[Partition]:
    """Make `table` (goharvest's columns, an `id` primary key) partitioned by id range, in one transaction
    that holds an exclusive lock on it: the rows it holds become the first partition, then `AHEAD`
    partitions of `size` ids and a DEFAULT one. The id keeps counting from where it was."""
    if size < 1000:
        raise PartitionError(f"--size: must be at least 1000 ids, got {size}")
    ident = table_identifier(table)
    schema, _, bare = table.rpartition(".")
    old = sql.Identifier(*_schema(schema), f"{bare}_unpartitioned")
    sequence = sql.Identifier(*_schema(schema), f"{bare}_id_seq")
    with conn.transaction():
        if is_partitioned(conn, table):
            raise PartitionError(f"table {table!r} is partitioned already")
        conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(ident))
        last = conn.execute(sql.SQL("SELECT greatest(coalesce(max(id), 0), coalesce(pg_sequence_last_value("
                                    "pg_get_serial_sequence({}, 'id')), 0)) FROM {}").format(
                                        sql.Literal(table_name(table)), ident)).fetchone()[0]
        boundary = last + 1
        conn.execute(sql.SQL("ALTER TABLE {} RENAME TO {}").format(ident, sql.Identifier(f"{bare}_unpartitioned")))
        old_name = table_name(".".join(filter(None, [schema, f"{bare}_unpartitioned"])))
        identity, owned = conn.execute(
            "SELECT a.attidentity <> '', pg_get_serial_sequence(%(old)s, 'id') FROM pg_attribute a "
            "WHERE a.attrelid = to_regclass(%(old)s) AND a.attname = 'id'", {"old": old_name}).fetchone()
        conn.execute(sql.SQL(
            "CREATE TABLE {} (LIKE {} INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE) "
            "PARTITION BY RANGE (id)").format(ident, old))
        if identity or owned is None:
            # An identity (Django's BigAutoField) cannot move to a partitioned parent on every Postgres we
            # support: a sequence of the parent's own takes over where it was.
            conn.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN id DROP IDENTITY IF EXISTS").format(old))
            conn.execute(sql.SQL("CREATE SEQUENCE {} START WITH {}").format(sequence, sql.Literal(boundary)))
            owned = ".".join(filter(None, [schema, f"{bare}_id_seq"]))
        conn.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN id DROP DEFAULT").format(old))
        conn.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN id SET DEFAULT nextval({}::regclass)").format(
            ident, sql.Literal(owned)))
        conn.execute(sql.SQL("ALTER SEQUENCE {} OWNED BY {}.id").format(sql.SQL(owned), ident))
        conn.execute(sql.SQL("ALTER TABLE {} ADD PRIMARY KEY (id)").format(ident))
        # The old rows, all below the boundary, become the first partition (the CHECK spares a scan).
        conn.execute(sql.SQL("ALTER TABLE {} ADD CONSTRAINT outbox_first_range CHECK (id < {})").format(
            old, sql.Literal(boundary)))
        conn.execute(sql.SQL("ALTER TABLE {} ATTACH PARTITION {} FOR VALUES FROM (MINVALUE) TO ({})").format(
            ident, old, sql.Literal(boundary)))
        conn.execute(sql.SQL("ALTER TABLE {} DROP CONSTRAINT outbox_first_range").format(old))
        conn.execute(sql.SQL("CREATE TABLE {} PARTITION OF {} DEFAULT WITH ({})").format(
            sql.Identifier(*_schema(schema), f"{bare}_default"), ident, sql.SQL(STORAGE)))
        for index in range(AHEAD):
            _create(conn, table, boundary + index * size, boundary + (index + 1) * size)
        _indexes_to_parent(conn, table, old_name)
        _notify_trigger(conn, table, old)
    return partitions(conn, table)


_INDEX_DEFINITION = re.compile(r"CREATE INDEX \S+ ON (?:ONLY )?\S+ (?P<how>USING .*)", re.S)


def _indexes_to_parent(conn: psycopg.Connection, table: str, old_name: str) -> None:
    """The old table's other indexes (the failed rows' partial index, which the console's stuck-record lookups use)
    on the partitioned parent under their own names: Postgres builds them on every partition, now and later, and
    takes the old table's own, renamed, for its partition (no rebuild)."""
    schema = table.rpartition(".")[0]
    found = conn.execute("SELECT c.relname, pg_get_indexdef(i.indexrelid) FROM pg_index i "
                         "JOIN pg_class c ON c.oid = i.indexrelid "
                         "WHERE i.indrelid = to_regclass(%(old)s) AND NOT i.indisunique", {"old": old_name}).fetchall()
    for name, definition in found:
        match = _INDEX_DEFINITION.fullmatch(definition)
        if match is None:
            log.warning("Index %s of %s not made on the partitioned table: %s", name, old_name, definition)
            continue
        conn.execute(sql.SQL("ALTER INDEX {} RENAME TO {}").format(
            sql.Identifier(*_schema(schema), name), sql.Identifier(f"{name[:49]}_unpartitioned")))
        conn.execute(sql.SQL("CREATE INDEX {} ON {} {}").format(sql.Identifier(name), table_identifier(table),
                                                                sql.SQL(match["how"])))


def _notify_trigger(conn: psycopg.Connection, table: str, old: sql.Composable) -> None:
    """The NOTIFY trigger moves to the new parent (the channel is named by the parent's oid)."""
    exists = conn.execute("SELECT EXISTS (SELECT 1 FROM pg_proc WHERE proname = 'outbox_notify')").fetchone()[0]
    if not exists:
        return
    conn.execute(sql.SQL("DROP TRIGGER IF EXISTS outbox_notify ON {}").format(old))
    conn.execute(sql.SQL("CREATE TRIGGER outbox_notify AFTER INSERT ON {} FOR EACH STATEMENT "
                         "EXECUTE FUNCTION outbox_notify()").format(table_identifier(table)))


def _create(conn: psycopg.Connection, table: str, lo: int, hi: int) -> None:
    schema, _, bare = table.rpartition(".")
    name = sql.Identifier(*_schema(schema), f"{bare}_p{lo}")
    conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} PARTITION OF {} FOR VALUES FROM ({}) TO ({}) WITH ({})").format(
        name, table_identifier(table), sql.Literal(lo), sql.Literal(hi), sql.SQL(STORAGE)))


@dataclass
class KeepResult:
    created: list[str]
    truncated: list[str]
    dropped: list[str]


def keep(conn: psycopg.Connection, table: str) -> KeepResult:
    """One pass: partitions ahead of the id sequence; drained ones (every partition wholly below the
    one being written, with no live row) truncated and dropped. `conn` is in autocommit mode."""
    result = KeepResult([], [], [])
    every = partitions(conn, table)
    ranges = [p for p in every if not p.default]
    bounded = [p for p in ranges if p.hi is not None and p.lo is not None]
    if not bounded:
        return result
    size = bounded[-1].hi - bounded[-1].lo
    last = conn.execute(LAST_ID, {"table": table_name(table)}).fetchone()[0] or 0
    top = bounded[-1].hi
    if top <= last:
        # The ids overtook every partition (a burst faster than KEEP_INTERVAL could follow): the DEFAULT
        # partition holds them, and no partition can be made over its rows. Start again just past the last id.
        default = next((p for p in every if p.default), None)
        restarted = _restart(conn, table, default, size) if default is not None else None
        if restarted is not None:
            result.created.append(f"{restarted - size}-{restarted - 1}")
            top, last = restarted, restarted - size - 1
    while last < top <= last + AHEAD * size:
        try:
            with conn.transaction():
                conn.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
                _create(conn, table, top, top + size)
        except psycopg.errors.LockNotAvailable:
            break  # writers are busy: next time
        except psycopg.Error as error:  # the DEFAULT partition has rows in that range: it keeps them
            log.warning("Could not create partition of %s for ids %d-%d: %s", table, top, top + size - 1,
                        first_line(error))
            break
        result.created.append(f"{top}-{top + size - 1}")
        top += size
    now = partitions(conn, table)
    # The highest range partition is never dropped, only truncated: its bounds give the next one's width.
    highest = max((p.hi for p in now if not p.default and p.hi is not None), default=None)
    for partition in now:
        if partition.default:
            # Ids beyond the partitions went here (a burst faster than the partitions ahead were made):
            # emptied, its files are truncated like a drained partition's, and it stays.
            if _drain(conn, partition, drop=False)[0]:
                result.truncated.append(partition.name)
            continue
        if partition.hi is None or partition.hi > last:
            continue  # the partition being written (or ahead): ids in it may still come
        truncated, dropped = _drain(conn, partition, drop=partition.hi != highest)
        if truncated:
            result.truncated.append(partition.name)
        if dropped:
            result.dropped.append(partition.name)
    return result


def _restart(conn: psycopg.Connection, table: str, default: Partition, size: int) -> int | None:
    """Make a partition from just past the last id, under a lock on the DEFAULT partition so no row enters it
    meanwhile (every id it holds was then taken before the sequence is read); returns its upper bound, or
    None when a writer holds the DEFAULT partition (next pass)."""
    try:
        with conn.transaction():
            conn.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
            conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(sql.SQL(default.name)))
            last = conn.execute(LAST_ID, {"table": table_name(table)}).fetchone()[0] or 0
            _create(conn, table, last + 1, last + 1 + size)
            return last + 1 + size
    except psycopg.errors.LockNotAvailable:
        return None
    except psycopg.Error as error:
        log.warning("Could not make a partition of %s past its last id: %s", table, first_line(error))
        return None


def _drain(conn: psycopg.Connection, partition: Partition, *, drop: bool = True) -> tuple[bool, bool]:
    """Truncate and drop a partition that holds no live row: (truncated, dropped). Nothing happens
    while its lock is not free at once, or while rows wait in it; the drop waits for a moment when
    the parent's lock is free too (writers between statements), the truncate does not."""
    ident = sql.SQL(partition.name)
    try:
        with conn.transaction():
            conn.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
            # Under this lock no writer inserts into it and every commit into it is visible: an empty
            # partition stays empty until this transaction ends (a late id then goes to the DEFAULT one).
            conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(ident))
            if conn.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM {})").format(ident)).fetchone()[0]:
                return False, False
            truncated = bool(conn.execute("SELECT pg_relation_size(%s::regclass) > 0", [partition.name]).fetchone()[0])
            if truncated:
                conn.execute(sql.SQL("TRUNCATE {}").format(ident))
            if not drop:
                return truncated, False
            try:
                with conn.transaction():  # a savepoint: the truncate stands if the drop must wait
                    conn.execute(sql.SQL("DROP TABLE {}").format(ident))
            except psycopg.errors.LockNotAvailable:
                return truncated, False
            return truncated, True
    except psycopg.errors.LockNotAvailable:
        return False, False
