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

#: goharvest's columns: any application can INSERT into a table that has them.
COLUMNS = ("id", "create_time", "kafka_topic", "kafka_key", "kafka_value", "kafka_header_keys",
           "kafka_header_values", "leader_id")
#: Columns beyond goharvest's that this app's migrations add; the engine uses them when present.
FAILURE_COLUMNS = ("reset_count", "last_error")

#: Headers the harvester adds to every message, beside the record's own.
HEADER_ID = "outbox-id"
HEADER_CREATE_TIME = "outbox-create-time"
#: Added to a record published to the dead-letter topic: why it was parked, and its own topic.
HEADER_DEAD_LETTER_REASON = "outbox-dead-letter-reason"
HEADER_TOPIC = "outbox-topic"
RESERVED_HEADERS = frozenset({HEADER_ID, HEADER_CREATE_TIME})


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
    #: The term that marked the row (None while pending).
    leader_id: uuid.UUID | None = None
    #: The row version (Postgres xmin) when last read or written by the engine: a held record
    #: whose version changes was touched by someone else (its value fixed, or a retry asked for).
    version: int | None = None


# -- SQL --------------------------------------------------------------------------------------
# Every statement names the table as {table}; store.py fills it in as a quoted identifier.

_RETURNING = ("RETURNING id, create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, "
              "kafka_header_values, leader_id, xmin::text::bigint")

# Mark: one atomic UPDATE ... RETURNING of the earliest rows this term has not marked. Rows left
# by a dead leader look exactly like new ones (unimodal recovery). A mark starts above the
# watermark (`after`: see core.Core._advance_watermark), so its cost does not grow with the rows
# purged long ago, whose dead index entries linger until vacuum; a rescan walks the region below
# it in chunks, for rows that came back some other way (an operator's requeue).
MARK = f"""
UPDATE {{table}} SET leader_id = %(leader_id)s
WHERE id IN (
  SELECT id FROM {{table}}
  WHERE id > %(after)s AND (leader_id IS NULL OR leader_id <> %(leader_id)s)
  ORDER BY id
  LIMIT %(limit)s
)
{_RETURNING}
"""
# Read just before each mark: the oldest running transaction and the next transaction id.
SNAPSHOT = "SELECT pg_snapshot_xmin(s)::text::bigint, pg_snapshot_xmax(s)::text::bigint FROM pg_current_snapshot() s"
RESCAN = f"""
UPDATE {{table}} SET leader_id = %(leader_id)s
WHERE id IN (
  SELECT id FROM {{table}}
  WHERE id > %(after)s AND id <= %(upto)s
    AND (leader_id IS NULL OR leader_id <> %(leader_id)s)
  ORDER BY id
  LIMIT %(limit)s
)
{_RETURNING}
"""

# Whether the leader's fence session (by its backend pid) still holds the table's fence. Purges and
# resets run on another session and answer this too, so a leader whose fence session ended (and
# someone else may be marking) learns it at its next purge, and stops sending.
FENCE_HELD = """
SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND classid = %(class)s AND objid = %(table_oid)s
                 AND objsubid = 1 AND granted AND pid = %(fence_pid)s) AS held
"""

# Purge: delete delivered rows, each only while it is still marked by the term that sent it, so a
# stale leader can never delete a row another term has taken over. Answers (fence held, rows gone).
PURGE = f"""
WITH fence AS ({FENCE_HELD}),
gone AS (
  DELETE FROM {{table}} AS o USING unnest(%(ids)s::bigint[], %(leader_ids)s::uuid[]) AS p(id, leader_id)
  WHERE o.id = p.id AND o.leader_id = p.leader_id
  RETURNING 1
)
SELECT (SELECT held FROM fence), (SELECT count(*) FROM gone)
"""

# Reset: put rows whose delivery failed back in scope of the next mark (same guard and answer as
# purge). Tables made by this app's migrations also count the failure and keep the error.
RESET = f"""
WITH fence AS ({FENCE_HELD}),
reset AS (
  UPDATE {{table}} AS o SET leader_id = NULL
  FROM unnest(%(ids)s::bigint[], %(leader_ids)s::uuid[]) AS p(id, leader_id)
  WHERE o.id = p.id AND o.leader_id = p.leader_id
  RETURNING 1
)
SELECT (SELECT held FROM fence), (SELECT count(*) FROM reset)
"""
RESET_COUNTED = f"""
WITH fence AS ({FENCE_HELD}),
reset AS (
  UPDATE {{table}} AS o SET leader_id = NULL, reset_count = o.reset_count + 1, last_error = p.error
  FROM unnest(%(ids)s::bigint[], %(leader_ids)s::uuid[], %(errors)s::text[]) AS p(id, leader_id, error)
  WHERE o.id = p.id AND o.leader_id = p.leader_id
  RETURNING 1
)
SELECT (SELECT held FROM fence), (SELECT count(*) FROM reset)
"""

# Hold: a poison record stays marked (its key waits); say why on the row. Returns the new version.
HOLD = """
UPDATE {table} SET leader_id = leader_id WHERE id = %(id)s AND leader_id = %(leader_id)s RETURNING xmin::text::bigint
"""
HOLD_COUNTED = """
UPDATE {table} SET reset_count = reset_count + 1, last_error = %(error)s
WHERE id = %(id)s AND leader_id = %(leader_id)s RETURNING xmin::text::bigint
"""

# Held rows as they are now: gone (deleted, parked), or changed (a new version).
CHECK_HELD = """
SELECT id, create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values, leader_id,
       xmin::text::bigint
FROM {table} WHERE id = ANY(%(ids)s::bigint[])
"""

# Park: move a row to the dead-letter table in one statement (so it is in exactly one of them).
PARK = """
WITH moved AS (
  DELETE FROM {table} WHERE id = %(id)s AND leader_id = %(leader_id)s
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
FENCE_HOLDER = """
SELECT a.pid, a.application_name, coalesce(a.client_addr::text, 'local')
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.classid = %(class)s AND l.objid = %(table_oid)s AND l.objsubid = 1
  AND l.granted AND l.pid <> pg_backend_pid()
"""
TERMINATE = "SELECT pg_terminate_backend(%(pid)s)"
TABLE_OID = "SELECT to_regclass(%(table)s)::oid::bigint"

# Requeue (an operator's action): put rows back in scope of the next mark, clearing their failure
# count, but never rows marked by a live leader: one of those may be in flight, and re-marking it
# behind a later record of its key would publish the two out of order.
REQUEUE = """
UPDATE {table} SET leader_id = NULL{failure_columns}
WHERE id = ANY(%(ids)s) AND (leader_id IS NULL OR NOT (leader_id = ANY(%(live)s::uuid[])))
"""

# Does the table exist, and does it have goharvest's columns?
TABLE_COLUMNS = """
SELECT attname FROM pg_attribute
WHERE attrelid = to_regclass(%(table)s) AND attnum > 0 AND NOT attisdropped
"""


def iso_utc(created: datetime) -> str:
    """The outbox-create-time header: ISO 8601 in UTC."""
    return created.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


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
