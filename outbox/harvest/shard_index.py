"""What a sharded group needs in the database before a replica joins it: the table of shard terms (where each
shard's leader says whether it let go settled, store.CLAIM_SHARD), and the table's index for its number of shards
(sharding.py), built once however many replicas start together. shards.py prepares it at each replica's start;
`manage.py outbox_reshard` builds a new number's index ahead of a change."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import psycopg

from outbox.harvest import contract, sharding
from outbox.harvest.config import HarvestConfig
from outbox.harvest.store import (
    MIGRATE_HINT,
    StoreError,
    close_quietly,
    connect,
    describe_dsn,
    shard_terms_table,
    table_identifier,
    table_name,
)
from outbox.reasons import first_line

log = logging.getLogger("outbox.harvest.shards")


def session(dsn: str) -> psycopg.Connection:
    """An autocommit session for the shard terms and indexes (reshard.py's too); StoreError, one line, if none."""
    try:
        return connect(dsn, "shards")
    except psycopg.Error as error:
        raise StoreError(f"cannot connect to Postgres at {describe_dsn(dsn)}: {first_line(error)}") from None


def prepare_table(config: HarvestConfig, check_group: Callable[[], None] = lambda: None) -> None:
    """Before a sharded replica joins its group, on one session: the table of shard terms is there, then
    `check_group()` (the leader topic has a partition per shard: a replica of another number than its group's
    builds no index, and one with no shard terms table makes no topic), then the table's index for its shards
    exists (made now if not)."""
    conn = session(config.dsn)
    try:
        check_shard_terms(conn, config)
        check_group()
        create_shard_index(conn, config.table, config.shards)
    finally:
        close_quietly(conn)


def ensure_shard_index(dsn: str, table: str, shards: int) -> None:
    """create_shard_index on a session of its own (manage.py outbox_reshard)."""
    conn = session(dsn)
    try:
        create_shard_index(conn, table, shards)
    finally:
        close_quietly(conn)


#: Seconds between a replica's looks while another builds the shard index.
INDEX_BUILD_POLL = 0.2


def create_shard_index(conn: psycopg.Connection, table: str, shards: int, *, poll: float = INDEX_BUILD_POLL) -> None:
    """Create the table's index for `shards` shards unless it exists (sharding.py). CONCURRENTLY, so
    writers go on meanwhile (a partitioned table cannot: its index is built directly); `conn` is in
    autocommit mode.

    Replicas that start together build it once: the one that takes the build's advisory lock builds it,
    the others look again every `poll` seconds until it is there. They poll (pg_try_advisory_lock) rather
    than wait in the lock, because a session waiting holds a transaction open and CREATE INDEX
    CONCURRENTLY waits for every older transaction: the two would deadlock. Built at once, the builds
    failed ("deadlock detected", "tuple concurrently updated"), and one replica could drop another's
    index half-built, taking it for an interrupted build.
    """
    try:
        schema = table.rpartition(".")[0]
        index = f"{schema}.{sharding.index_name(table, shards)}" if schema else sharding.index_name(table, shards)
        oid = conn.execute(contract.TABLE_OID, {"table": table_name(table)}).fetchone()[0]
        key = sharding.lock_key(sharding.index_build_class(shards), int(oid or 0))
        waiting = False
        while not conn.execute("SELECT pg_try_advisory_lock(%s)", [key]).fetchone()[0]:
            if _index_state(conn, index):
                return
            if not waiting:
                log.info("Waiting for another replica to build index %s for %d shards of %s", index, shards, table)
                waiting = True
            time.sleep(poll)
        try:
            state = _index_state(conn, index)
            if state:
                return
            if state is not None:  # an interrupted CREATE INDEX CONCURRENTLY leaves an invalid index
                conn.execute(psycopg.sql.SQL("DROP INDEX IF EXISTS {}").format(table_identifier(index)))
            partitioned = conn.execute("SELECT EXISTS (SELECT 1 FROM pg_partitioned_table WHERE partrelid = "
                                       "to_regclass(%s))", [table_name(table)]).fetchone()[0]
            log.info("Creating index %s for %d shards of %s (once)", index, shards, table)
            conn.execute(sharding.create_index_sql(table, shards, concurrently=not partitioned))
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", [key])
    except psycopg.Error as error:
        raise StoreError(f"cannot create the index for {shards} shards on {table!r}: {first_line(error)}") from None


def _index_state(conn: psycopg.Connection, index: str) -> bool | None:
    """Whether `index` is valid (None: there is no such index)."""
    row = conn.execute("SELECT i.indisvalid FROM pg_index i WHERE i.indexrelid = to_regclass(%s)",
                       [table_name(index)]).fetchone()
    return None if row is None else bool(row[0])


def check_shard_terms(conn: psycopg.Connection, config: HarvestConfig) -> None:
    """A shard's hand-off needs the table of shard terms (store.py, CLAIM_SHARD): is it there?"""
    if not config.status_table:
        raise StoreError("sharded harvesting needs the status table (status_table) and the table of shard terms "
                         "beside it: set status_table")
    terms = shard_terms_table(config.status_table)
    try:
        found = conn.execute("SELECT to_regclass(%s)", [table_name(terms)]).fetchone()[0]
    except psycopg.Error as error:
        raise StoreError(f"cannot read table {terms!r}: {first_line(error)}") from None
    if found is None:
        raise StoreError(f"sharded harvesting needs table {terms!r}, where each shard's leader says whether it "
                         f"let go settled ({MIGRATE_HINT})")
