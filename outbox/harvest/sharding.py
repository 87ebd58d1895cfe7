"""Shards: a record's shard is a stable hash of its key, the same in Python and in SQL.

With `shards` = N > 1, each shard is harvested by its own leader (an engine of its own in whichever
replica Kafka's group protocol assigned partition s of the leader topic, shards.py). A key lives in
one shard, so per-key order needs nothing more. The hash is the first 32 bits of the key's MD5,
unsigned, modulo N: Postgres computes it from the key's bytes in the database's encoding (UTF-8,
which is what Python hashes), so both sides agree without a column or a function in the table.
Plain-SQL writers change nothing.

A shard's marks read through an expression index on (shard, id), one per N (the planner matches an
index expression only to the same text with the same constant): a shard's mark walks only its own
rows, as the unsharded mark walks the primary key. `ensure_index` creates it.

Fences. Each shard's leader holds an advisory lock of its own (class SHARD_CLASS_BASE + (N-1)*256 + s,
objid the table's oid) and, shared, two more: the table's unsharded fence key (so no unsharded
leader can publish beside shards) and the key of its N (so no group sharded differently can: a
leader that sees another N's key held lets its own go). Changing N is therefore safe by itself:
a new N's shards lead only once every old N's leader has settled and let go.
"""

from __future__ import annotations

import hashlib

from psycopg import sql

#: At most this many shards (the fence's lock classes leave room for exactly this many).
MAX_SHARDS = 256
#: Advisory-lock classes (the high 32 bits of the key; the table's oid is the low 32).
SHARD_CLASS_BASE = 0x0B0D0000
SHARD_COUNT_CLASS_BASE = 0x0B0E0000
INDEX_BUILD_CLASS_BASE = 0x0B0F0000


def shard_of(key: str, shards: int) -> int:
    """The shard of a record's key (as shard_expression computes it in SQL)."""
    if shards <= 1:
        return 0
    return int.from_bytes(hashlib.md5(key.encode(), usedforsecurity=False).digest()[:4], "big") % shards


def shard_expression(shards: int, column: str = "kafka_key") -> str:
    """The SQL of a row's shard, with N written in (an index expression matches only its own constant)."""
    return f"mod(('x' || left(md5({column}), 8))::bit(32)::bigint, {int(shards)})"


def index_name(table: str, shards: int) -> str:
    """The name of the table's index for N shards (in the table's schema)."""
    base = table.rsplit(".", 1)[-1]
    return f"{base[:40]}_shard{int(shards)}_idx"


def create_index_sql(table: str, shards: int, *, concurrently: bool) -> sql.Composed:
    schema, _, name = table.rpartition(".")
    target = sql.Identifier(schema, name) if schema else sql.Identifier(name)
    return sql.SQL("CREATE INDEX {how} IF NOT EXISTS {index} ON {table} ({expr}, id)").format(
        how=sql.SQL("CONCURRENTLY" if concurrently else ""), index=sql.Identifier(index_name(table, shards)),
        table=target, expr=sql.SQL(shard_expression(shards)))


def engine_name(replica: str, shard: int) -> str:
    """The name of a replica's engine for one shard: its status row, fence session and heartbeats say it."""
    return f"{replica}-s{shard}"


def replica_of(engine: str, shard: int) -> str:
    """The replica an engine's name belongs to (the inverse of engine_name)."""
    suffix = f"-s{shard}"
    return engine[:-len(suffix)] if engine.endswith(suffix) else engine


def shard_class(shards: int, shard: int) -> int:
    """The advisory-lock class of one shard's fence."""
    return SHARD_CLASS_BASE + (shards - 1) * MAX_SHARDS + shard


def shard_count_class(shards: int) -> int:
    """The advisory-lock class every leader of an N-shard group holds (shared) while it leads."""
    return SHARD_COUNT_CLASS_BASE + shards


def index_build_class(shards: int) -> int:
    """The advisory-lock class held by the one session that builds a table's index for N shards."""
    return INDEX_BUILD_CLASS_BASE + shards


def lock_key(lock_class: int, table_oid: int) -> int:
    """A bigint advisory-lock key: the class in the high 32 bits, the table's oid in the low 32."""
    key = (lock_class << 32) | table_oid
    return key - (1 << 64) if key >= 1 << 63 else key


def shards_problem(value: object) -> str | None:
    """Why `value` is not a number of shards, or None."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SHARDS:
        return f"must be a whole number from 1 to {MAX_SHARDS}, got {value!r}"
    return None
