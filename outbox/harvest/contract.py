"""The contract between the outbox table, the engine and everything that reads them.

One place names the table's columns, the headers the harvester adds, the states a replica
reports, and the SQL the engine runs. The Django models, the dashboard and the tests check
themselves against these names rather than repeating them.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime

from outbox.harvest import sharding
from outbox.kafka.headers import HEADER_CREATE_TIME, HEADER_DEAD_LETTER_REASON, HEADER_ID, HEADER_TOPIC

#: goharvest's columns: any application can INSERT into a table that has them.
COLUMNS = ("id", "create_time", "kafka_topic", "kafka_key", "kafka_value", "kafka_header_keys",
           "kafka_header_values", "leader_id")
#: Columns beyond goharvest's that this app's migrations add; the engine uses them when present.
FAILURE_COLUMNS = ("reset_count", "last_error")

#: CloudEvents' Kafka binary mode. A record with ce_specversion is published with ce_id (its outbox id)
#: and ce_time (its create time) unless it has them already (outbox/cloudevents.py writes the others).
CE_SPECVERSION = "ce_specversion"
CE_ID = "ce_id"
CE_TIME = "ce_time"
CE_TYPE = "ce_type"
CE_SOURCE = "ce_source"
CE_SUBJECT = "ce_subject"
CONTENT_TYPE = "content-type"


class ReplicaState(enum.StrEnum):
    """What a replica says it is doing, in its status row, metrics and the health probe."""

    STANDBY = "standby"  # in the group, not leading
    LEADER = "leader"  # leads and publishes
    FENCED = "fenced"  # assigned but has not seen its own heartbeat: sends nothing
    BLOCKED = "blocked"  # leads its group but another replica holds the table's database fence
    STOPPING = "stopping"
    STOPPED = "stopped"  # stopped cleanly: its status row stays, so the health probe can say so, until pruned


@dataclass(frozen=True, slots=True)
class HeldRecord:
    """A held (poison) record as its leader reports it: the status row's `held` entries."""

    id: int
    key: str
    topic: str
    reason: str
    #: Times it failed on its own (this leadership).
    attempts: int
    #: Seconds since it was first held.
    held_for: float
    #: Records of its key the leader has marked and keeps waiting behind it...
    behind: int
    #: ...and whether more wait in the table beyond those.
    more_behind: bool

    def as_json(self) -> dict[str, object]:
        return {"id": self.id, "key": self.key, "topic": self.topic, "reason": self.reason, "attempts": self.attempts,
                "held_for": round(self.held_for, 1), "behind": self.behind, "more_behind": self.more_behind}


@dataclass(slots=True, eq=False)
class Record:
    """One outbox row: what stash() writes, what a mark returns, what the engine publishes."""

    id: int | None
    create_time: datetime | None
    topic: str
    key: str
    value: str | None
    header_keys: list[str] = field(default_factory=list)
    header_values: list[str] = field(default_factory=list)
    #: goharvest's mark column, as the row has it (this harvester does not write it).
    leader_id: uuid.UUID | None = None
    #: The row version (Postgres xmin) when last read or written by the engine: a held record
    #: whose version changes was touched by someone else (its value fixed, or a retry asked for).
    version: int | None = None


# -- SQL --------------------------------------------------------------------------------------
# Every statement names the table as {table}; store.py fills it in as a quoted identifier.
#
# Marking is reading. A row is published, then deleted: the harvester never writes anything else to
# a row it has not been asked to count a failure on, so harvesting costs the database one DELETE
# per record (and the statements around it), not an UPDATE as well. Which rows a term has taken is
# kept in the leader's memory: a new term (after a fail-over or a failure) reads the table again
# from its head, so rows left by a dead leader look exactly like new ones (unimodal recovery).

_COLUMNS = ("id, create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values, "
            "leader_id, xmin::text::bigint")

# Mark: the earliest rows above the highest id this term has read (`after`). Its cost does not
# grow with the rows purged before, whose dead index entries linger until vacuum (or while an old
# transaction holds the database's horizon): it starts above them.
# With shards, {above} reads only the shard's rows, through its index on (shard, id) (sharding.py:
# a row comparison, which the primary key cannot serve, so the planner never walks every shard's rows).
MARK = f"""
SELECT {_COLUMNS} FROM {{table}}
WHERE {{above}}
LIMIT %(limit)s
"""
# Gaps: ranges of ids below the highest read that were not visible then (their transactions had not
# committed, or rolled back), looked up by primary key until they appear or can no longer appear
# (see marking.py), lowest first: one index range scan per gap (a join would scan the whole index).
GAPS = f"""
SELECT o.* FROM unnest(%(los)s::bigint[], %(his)s::bigint[]) AS gap(lo, hi)
CROSS JOIN LATERAL (
  SELECT {_COLUMNS} FROM {{table}} WHERE id BETWEEN gap.lo AND gap.hi ORDER BY id LIMIT %(limit)s
) AS o
ORDER BY o.id
LIMIT %(limit)s
"""
UNSHARDED_ABOVE = "id > %(after)s ORDER BY id"
MAX_ID = 2**63 - 1


def mark_above(shards: int) -> str:
    """MARK's {above} for a table harvested in `shards` shards."""
    if shards <= 1:
        return UNSHARDED_ABOVE
    shard = sharding.shard_expression(shards)
    # Both bounds are row comparisons on (shard, id), which only the shard's index can serve (an equality on
    # the shard beside them would make the index walk the shard from its start), and the order is (shard,
    # id), the same as id's within one shard but one only that index gives: ordered by id, the planner may
    # walk the primary key from the table's head instead (EXPLAIN, in test_shards.py).
    return (f"({shard}, id) > (%(shard)s::bigint, %(after)s::bigint) AND ({shard}, id) <= (%(shard)s::bigint, "
            f"{MAX_ID}) ORDER BY {shard}, id")


def shard_gaps(shards: int) -> str:
    """GAPS for one shard of a table harvested in `shards` shards: each gap's lookup also asks for the shard.

    Nearly every pair of a shard's rows has other shards' ids between them, so a shard's term has a gap
    per row it read, each a bounded lookup: by the primary key over the gap (the few other shards' rows in
    it) or the shard's index, whichever the planner takes; either reads only the gap's ids. (Walking the
    shard's index once over all the gaps, with row comparisons for bounds, walked the purged rows' dead
    entries from the start of the shard: half a second a mark in a drain.)"""
    return GAPS.replace("WHERE id BETWEEN gap.lo AND gap.hi",
                        f"WHERE id BETWEEN gap.lo AND gap.hi AND {sharding.shard_expression(shards)} = %(shard)s")


# Read just before each mark: the transactions writing to the outbox now (a row-exclusive lock on
# it), by virtual transaction id, which a transaction has before it takes an id. A gap is forgotten
# only once the writers seen after it was recorded have all ended.
WRITERS = """
SELECT virtualtransaction FROM pg_locks
WHERE locktype = 'relation' AND relation = %(table_oid)s AND mode = 'RowExclusiveLock' AND granted
  AND pid IS DISTINCT FROM pg_backend_pid()
"""

# Whether the leader's fence session (by its backend pid) still holds the table's fence. Purges and
# resets run on another session and answer this too, so a leader whose fence session ended (and
# someone else may be marking) learns it at its next mark (which fails on the ended session) or at its
# next purge that reads it, and stops sending. A purge nothing waits on reads it only if no mark
# succeeded since the previous purge (PURGE_UNFENCED otherwise; Settling.purge_reads_fence): reading
# pg_locks costs the server more than the DELETE (docs/benchmarks.md).
FENCE_HELD = """
SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND classid = %(class)s AND objid = %(table_oid)s
                 AND objsubid = 1 AND granted AND pid = %(fence_pid)s) AS held
"""

# Purge: delete rows whose records Kafka acknowledged. Whoever deletes such a row (a leader that
# has since been replaced included), the record is published: nothing is lost, and the next term
# does not send it again. Answers (fence held, rows gone).
# Without %(durable)s its transaction commits asynchronously (synchronous_commit off for that one
# transaction: set_config(..., true), so no session keeps it, a pooler's neither); durable, with the
# session's own setting. cmd.Purge.durable says when a purge may be undone by a crash of the server.
PURGE_COMMIT = ("set_config('synchronous_commit', CASE WHEN %(durable)s THEN current_setting('synchronous_commit') "
                "ELSE 'off' END, true)")
PURGE = f"""
WITH fence AS ({FENCE_HELD}),
gone AS (DELETE FROM {{table}} WHERE id = ANY(%(ids)s::bigint[]) RETURNING 1)
SELECT (SELECT held FROM fence), (SELECT count(*) FROM gone), {PURGE_COMMIT}
"""

# The same purge without reading the fence: nothing waits on it, and a mark on the fence session
# succeeded since the last purge, so that session held the fence then. Answers (True, rows gone).
PURGE_UNFENCED = f"""
WITH gone AS (DELETE FROM {{table}} WHERE id = ANY(%(ids)s::bigint[]) RETURNING 1)
SELECT true, (SELECT count(*) FROM gone), {PURGE_COMMIT}
"""

# Reset: a delivery failed. The next term reads the row again anyway; tables made by this app's
# migrations also count the failure and keep the error (the dashboard shows them). Same answer.
RESET = f"""
WITH fence AS ({FENCE_HELD})
SELECT (SELECT held FROM fence), 0
"""
RESET_COUNTED = f"""
WITH fence AS ({FENCE_HELD}),
reset AS (
  UPDATE {{table}} AS o SET reset_count = o.reset_count + 1, last_error = p.error
  FROM unnest(%(ids)s::bigint[], %(errors)s::text[]) AS p(id, error)
  WHERE o.id = p.id
  RETURNING 1
)
SELECT (SELECT held FROM fence), (SELECT count(*) FROM reset)
"""

# Hold: a poison record stays in the table (its key waits); say why on the row, where the table can.
# Returns the row's version (xmin) after it: a later change of version is an operator's doing.
HOLD = """
SELECT xmin::text::bigint FROM {table} WHERE id = %(id)s
"""
HOLD_COUNTED = """
UPDATE {table} SET reset_count = reset_count + 1, last_error = %(error)s
WHERE id = %(id)s RETURNING xmin::text::bigint
"""

# Held rows as they are now: gone (deleted, parked), or changed (a new version).
CHECK_HELD = f"""
SELECT {_COLUMNS}
FROM {{table}} WHERE id = ANY(%(ids)s::bigint[])
"""

# Park: move a row to the dead-letter table in one statement (so it is in exactly one of them),
# only as the version that failed: a row an operator changed meanwhile is retried instead.
PARK = """
WITH moved AS (
  DELETE FROM {table} WHERE id = %(id)s AND xmin::text::bigint = %(version)s
  RETURNING id, create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values
)
INSERT INTO {dead_letters} (outbox_id, create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys,
                            kafka_header_values, reason, attempts, parked_at, parked_by, dead_letter_topic)
SELECT id, create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values,
       %(reason)s, %(attempts)s, now(), %(parked_by)s, %(dead_letter_topic)s
FROM moved
RETURNING outbox_id
"""

# The database fence: a session advisory lock per table, held by the leader's mark connection
# for as long as it leads. A second leader (another group, or a stale member of this one) cannot
# mark while the lock is held; a session that ends (crash, termination) releases it.
# The lock's bigint key is FENCE_CLASS in the high 32 bits and the table's oid in the low 32.
FENCE_CLASS = 0x0B0C
TAKE_FENCE = "SELECT pg_try_advisory_lock(%(key)s)"
RELEASE_FENCE = "SELECT pg_advisory_unlock(%(key)s)"
# Shards (sharding.py): each shard's leader holds its own fence, and shares the table's fence and its N's key.
TAKE_SHARED_FENCE = "SELECT pg_try_advisory_lock_shared(%(key)s)"
RELEASE_SHARED_FENCE = "SELECT pg_advisory_unlock_shared(%(key)s)"
# A shard's leader claims its shard's row on taking the fence (store.py), answering how the last leader
# left it: unsettled means its fence went with its session, with records maybe still in flight.
CLAIM_SHARD = """
WITH previous AS (
  SELECT settled, holder FROM {terms} WHERE table_oid = %(table_oid)s AND shards = %(shards)s AND shard = %(shard)s
), claimed AS (
  INSERT INTO {terms} (table_oid, shards, shard, holder, settled, updated)
  VALUES (%(table_oid)s, %(shards)s, %(shard)s, %(holder)s, false, now())
  ON CONFLICT (table_oid, shards, shard) DO UPDATE SET holder = EXCLUDED.holder, settled = false, updated = now()
  RETURNING 1
)
SELECT (SELECT settled FROM previous), (SELECT holder FROM previous), (SELECT count(*) FROM claimed)
"""
# ...and says it settled just before it lets the fence go with nothing in flight.
SETTLE_SHARD = """
UPDATE {terms} SET settled = true, updated = now()
WHERE table_oid = %(table_oid)s AND shards = %(shards)s AND shard = %(shard)s AND holder = %(holder)s
"""
# A leader of a group sharded another number of ways, holding its N's key (the N is in the class).
OTHER_SHARD_COUNT = """
SELECT a.pid, a.application_name, coalesce(a.client_addr::text, 'local'), l.classid::bigint - %(lo)s
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.objid = %(table_oid)s AND l.objsubid = 1 AND l.granted
  AND l.classid::bigint >= %(lo)s AND l.classid::bigint <= %(hi)s AND l.classid::bigint <> %(mine)s
LIMIT 1
"""
FENCE_HOLDER = """
SELECT a.pid, a.application_name, coalesce(a.client_addr::text, 'local')
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.classid = %(class)s AND l.objid = %(table_oid)s AND l.objsubid = 1
  AND l.granted AND l.pid <> pg_backend_pid()
"""
TERMINATE = "SELECT pg_terminate_backend(%(pid)s)"
TABLE_OID = "SELECT to_regclass(%(table)s)::oid::bigint"
# The schema a table is in (an unqualified name's is the first schema of the search_path that has it).
TABLE_SCHEMA = "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = %(oid)s"

# Requeue (an operator's action): clear rows' failure counts. A held row changes version with it,
# which its leader notices and retries the row at once; any other row is read again by the next term.
REQUEUE = """
UPDATE {table} SET reset_count = 0, last_error = NULL WHERE id = ANY(%(ids)s)
"""

# Does the table exist, and does it have goharvest's columns?
TABLE_COLUMNS = """
SELECT attname FROM pg_attribute
WHERE attrelid = to_regclass(%(table)s) AND attnum > 0 AND NOT attisdropped
"""


def iso_utc(created: datetime) -> str:
    """The outbox-create-time header: ISO 8601 in UTC."""
    return created.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def cloudevent_headers(record_id: int, created_text: str, header_keys: list[str]) -> list[tuple[str, str]]:
    """What a CloudEvent record (one with ce_specversion) still lacks: ce_id and ce_time."""
    missing = []
    if CE_ID not in header_keys:
        missing.append((CE_ID, str(record_id)))
    if CE_TIME not in header_keys:
        missing.append((CE_TIME, created_text))
    return missing


def dead_letter_headers(record_id: int, create_time: datetime, topic: str, headers: list[tuple[str, str]],
                        reason: str) -> list[tuple[str, str]]:
    """The headers of a parked record on the dead-letter topic: its own, then where it came from and why."""
    return [*headers, (HEADER_ID, str(record_id)), (HEADER_CREATE_TIME, iso_utc(create_time)),
            (HEADER_TOPIC, topic), (HEADER_DEAD_LETTER_REASON, reason)]


def fence_key(table_oid: int) -> int:
    """The advisory-lock key of a table's fence."""
    return (FENCE_CLASS << 32) | table_oid


def notify_channel(table_oid: int) -> str:
    """The channel the outbox table's trigger NOTIFYs after every statement that inserts rows.

    Named by the table's oid, so the trigger and the harvester agree however the table is spelled.
    """
    return f"outbox_{table_oid}"
