"""Who holds the database's horizon back, and how many dead rows the outbox carries meanwhile.

Vacuum removes a dead row only once no transaction could still see it: the oldest snapshot of any
session (an idle-in-transaction psql, a long report), a replication slot's xmin, a replica's
`hot_standby_feedback`, or a prepared transaction holds every table's dead rows in place. The
harvester itself does not wait for any of them (marking reads on from the highest id read; see
docs/guarantees.md, "Gaps"), but the outbox's dead rows pile up: its table and index grow until
the holder ends. The dashboard, `harvest_health` and the metric `outbox_horizon_age_seconds` say
who it is (docs/operations.md, "The horizon alarm"). Read here on any DB-API cursor: Django's
(outbox/horizon.py) or psycopg's (the stand-alone harvester's metrics).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: OUTBOX["horizon_warn_after"]'s default: a holder this old (seconds) is said.
WARN_AFTER = 60.0

# The oldest holder of each kind, by the age of the xid it holds back (sessions also by time): a session
# holds it by its snapshot (backend_xmin: a REPEATABLE READ transaction, a long query) or by its own
# transaction id (backend_xid: any transaction that wrote something and stays open).
HOLDERS = """
SELECT 'session' AS kind, pid, coalesce(nullif(application_name, ''), usename::text, '') AS name, state,
       greatest(age(backend_xmin), age(backend_xid)) AS xid_age,
       extract(epoch FROM now() - coalesce(xact_start, backend_start)) AS seconds
FROM pg_stat_activity
WHERE (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL) AND pid <> pg_backend_pid()
  AND backend_type = 'client backend'
UNION ALL
SELECT 'replication slot', active_pid, slot_name::text, CASE WHEN active THEN 'active' ELSE 'inactive' END,
       greatest(age(xmin), age(catalog_xmin)), NULL
FROM pg_replication_slots WHERE xmin IS NOT NULL OR catalog_xmin IS NOT NULL
UNION ALL
SELECT 'prepared transaction', NULL, gid, 'prepared', age(transaction), extract(epoch FROM now() - prepared)
FROM pg_prepared_xacts
UNION ALL
SELECT 'standby (hot_standby_feedback)', pid, application_name, state, age(backend_xmin), NULL
FROM pg_stat_replication WHERE backend_xmin IS NOT NULL
ORDER BY xid_age DESC NULLS LAST
LIMIT 1
"""
#: A holder Postgres gives no time for (a replication slot, a standby) is old enough to say so this far behind.
WARN_XID_AGE = 1_000_000
DEAD_ROWS = "SELECT coalesce(n_dead_tup, 0) FROM pg_stat_user_tables WHERE relid = to_regclass(%s)"


@dataclass(frozen=True)
class Holder:
    """The oldest thing holding the horizon back."""

    kind: str
    pid: int | None
    name: str
    state: str
    xid_age: int
    #: How long it has held it (None where Postgres does not say: slots and standbys).
    seconds: float | None

    def __str__(self) -> str:
        who = f"{self.kind} {self.pid}" if self.pid else self.kind
        name = f" ({self.name}, {self.state})" if self.name else f" ({self.state})"
        held = f" for {_duration(self.seconds)}" if self.seconds is not None else ""
        return f"{who}{name}{held}, {self.xid_age:,} transactions behind"


@dataclass(frozen=True)
class Horizon:
    holder: Holder | None
    #: Dead rows of the outbox table (Postgres's statistics).
    dead_rows: int
    #: `horizon_warn_after` seconds: the holder is old enough to say so.
    warn_after: float

    @property
    def held_back(self) -> bool:
        holder = self.holder
        if holder is None:
            return False
        if holder.seconds is None:
            return holder.xid_age >= WARN_XID_AGE
        return holder.seconds >= self.warn_after

    @property
    def age(self) -> float:
        """Seconds the oldest session or prepared transaction has held the horizon (0 if none does)."""
        holder = self.holder
        if holder is None or holder.seconds is None:
            return 0.0
        return holder.seconds

    def message(self) -> str:
        return (f"The database's horizon is held back by {self.holder}: vacuum cannot remove the outbox's "
                f"{self.dead_rows:,} dead rows (or any table's) until it ends. Harvesting does not wait for it, "
                f"but the table and its index grow meanwhile. End that transaction, or see docs/operations.md, "
                f"\"The horizon alarm\".")


def read_with(cursor: Any, table: str, warn_after: float = WARN_AFTER) -> Horizon:
    """What holds the horizon back now (one query) and `table`'s dead rows (its statistics), on `cursor`."""
    cursor.execute(HOLDERS)
    row = cursor.fetchone()
    cursor.execute(DEAD_ROWS, [table])
    dead = cursor.fetchone()
    holder = None
    if row is not None:
        kind, pid, name, state, xid_age, seconds = row
        holder = Holder(kind, pid, name or "", state or "", int(xid_age or 0),
                        None if seconds is None else float(seconds))
    return Horizon(holder, int(dead[0]) if dead else 0, warn_after)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} minutes"
    return f"{seconds / 3600:.1f} hours"
