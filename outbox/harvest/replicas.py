"""The replicas' status rows, sorted by what each is doing, and the health probe's verdict on them: what
`manage.py harvest_health` (rows read by Django's ORM, outbox.states) and `outbox-harvest health` (rows read
here, by psycopg) both decide. Rows are anything with the status table's columns as attributes.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from outbox.harvest import sharding
from outbox.harvest.contract import ReplicaState
from outbox.harvest.events import rate_text
from outbox.harvest.store import table_identifier

#: A replica not seen for this long is gone (OUTBOX["status_gone_after"]'s default).
GONE_AFTER = 20.0


@dataclass(frozen=True)
class Replicas:
    """The replicas' status rows, sorted by what they are doing now."""

    leaders: list[Any]
    blocked: list[Any]
    standbys: list[Any]
    gone: list[Any]
    #: Stopped cleanly (SIGTERM, stop()): their rows stay until pruned, saying when.
    stopped: list[Any] = field(default_factory=list)
    #: The outbox table whose records the console shows (None: every row counts). A process harvesting
    #: many outboxes (outbox/many.py) writes its engines' rows into the same status table: their terms'
    #: ids and marks are of other tables, and say nothing of this one's records.
    table: str | None = None
    #: Leaders' rows (among `gone`) last written before another replica took the lead of the same group, shard and
    #: table: a killed leader writes no last row, and its new leader's row says when it took over.
    superseded: list[Any] = field(default_factory=list)

    @classmethod
    def sort(cls, rows: Iterable[Any], now: datetime, gone_after: float, table: str | None = None) -> Replicas:
        """The rows sorted: a replica not seen for `gone_after` seconds is gone, and so is a leader not seen since
        another one took its lead (superseded()); a stopped one says when."""
        rows = list(rows)
        stopped = sorted((r for r in rows if r.state == ReplicaState.STOPPED), key=lambda r: r.last_seen,
                         reverse=True)
        rows = [r for r in rows if r.state != ReplicaState.STOPPED]
        live = [r for r in rows if (now - r.last_seen).total_seconds() <= gone_after]
        superseded = _superseded([r for r in live if r.state == ReplicaState.LEADER])
        live = [r for r in live if r not in superseded]
        leaders = [r for r in live if r.state == ReplicaState.LEADER]
        blocked = [r for r in live if r.state == ReplicaState.BLOCKED]
        standbys = [r for r in live if r not in leaders and r not in blocked]
        return cls(leaders=leaders, blocked=blocked, standbys=standbys,
                   gone=[*superseded, *(r for r in rows if (now - r.last_seen).total_seconds() > gone_after)],
                   stopped=stopped, table=table, superseded=superseded)

    @property
    def live(self) -> list[Any]:
        return self.leaders + self.blocked + self.standbys

    @property
    def rows(self) -> list[Any]:
        """Every status row, whatever its state."""
        return self.live + self.gone + self.stopped

    def harvests_table(self, row: Any) -> bool:
        """Whether `row`'s engine harvests the console's table (an unqualified name is public's)."""
        return self.table is None or same_table(row.harvested_table, self.table)

    @property
    def own_leaders(self) -> list[Any]:
        """The leaders of the console's table."""
        return [r for r in self.leaders if self.harvests_table(r)]

    @property
    def live_leader_ids(self) -> list[uuid.UUID]:
        """Leader ids of the terms with records of the console's table in flight now. A live replica's status
        row carries the leader id of its term, and keeps it while records of an ended or refreshed term are
        still in flight or held, whatever its state."""
        return [r.leader_id for r in self.live if r.leader_id is not None and self.harvests_table(r)]

    @property
    def marked_upto(self) -> int | None:
        """The highest id of the console's table a live term has read: the rows up to it still there are in
        flight."""
        return max((r.marked_upto for r in self.live
                    if r.leader_id is not None and r.marked_upto is not None and self.harvests_table(r)),
                   default=None)


def same_table(harvested: str, table: str) -> bool:
    """Whether a status row's `harvested_table` names `table` (the unqualified name is public's, as the
    default search_path resolves it)."""
    def qualified(name: str) -> str:
        return name if "." in name else f"public.{name}"
    return qualified(harvested) == qualified(table)


def groups_without_leader(found: Replicas) -> list[tuple[str, str]]:
    """Unsharded groups with a live standby and no live leader, while other groups have one (many outboxes in
    one status table; with none at all the dashboard says so once): (group, the table it harvests)."""
    if not found.leaders:
        return []
    led = {r.leader_group for r in found.leaders}
    waiting = {(r.leader_group, r.harvested_table) for r in found.standbys if (r.shards or 1) == 1}
    return sorted((group, table) for group, table in waiting if group not in led)


def shards_without_leader(found: Replicas) -> list[tuple[str, int, list[int]]]:
    """Sharded groups with live replicas whose shards are not all led: (group, shards, the shards without one)."""
    result = []
    for group in sorted({r.leader_group for r in found.live if (r.shards or 1) > 1}):
        shards = max(r.shards for r in found.live if r.leader_group == group)
        led = {r.shard for r in found.leaders if r.leader_group == group}
        missing = [shard for shard in range(shards) if shard not in led]
        if missing:
            result.append((group, shards, missing))
    return result


def health(found: Replicas, now: datetime, *, name: str | None = None, host: str | None = None, any: bool = False,
           require_leader: bool = False, gone_after: float = GONE_AFTER, counts: str = "") -> tuple[bool, str]:
    """(healthy, why) for the replicas of `name` (a replica, or a sharded replica's engines, or a process's
    outboxes), else of `host` (default: this host), else of any host; `counts` ends the reason."""
    tail = f"; {counts}" if counts else ""
    if name:
        scope = f"replica {name!r}"

        def matches(r: Any) -> bool:
            return r.name == name or (r.shard is not None and sharding.replica_of(r.name, r.shard) == name) \
                or ("/" not in name and r.name.partition("/")[0] == name)
    elif any:
        scope, matches = "any replica", lambda r: True
    else:
        host = host or socket.gethostname()
        scope, matches = f"replicas on host {host!r}", lambda r: r.host == host
    live = [r for r in found.live if matches(r)]
    if not live:
        last = max((r for r in [*found.gone, *found.stopped] if matches(r)), key=lambda r: r.last_seen, default=None)
        if last is None:
            when = "never seen"
        elif last in found.superseded:
            when = f"{last.name} last seen {(now - last.last_seen).total_seconds():.0f}s ago, before another replica " \
                   "took its lead"
        elif last in found.stopped:
            when = (f"{last.name} stopped cleanly at {last.last_seen.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC, "
                    f"{(now - last.last_seen).total_seconds():.0f}s ago")
        else:
            when = f"{last.name} last seen {(now - last.last_seen).total_seconds():.0f}s ago"
        return False, f"no live harvester for {scope} ({when}; gone after {gone_after:g}s){tail}"
    blocked = [r for r in found.blocked if matches(r)]
    if blocked:
        r = blocked[0]
        return False, (f"{r.name} (leader group {r.leader_group}) is blocked: {r.blocked_by or 'another replica'} "
                       f"holds the table's database fence, so it publishes nothing{tail}")
    if require_leader and not found.leaders:
        return False, f"{_processes(live)} live replica(s) for {scope}, but none leads{tail}"
    leaderless = shards_without_leader(found)
    if require_leader and leaderless:
        group, shards, missing = leaderless[0]
        return False, (f"group {group} has {shards} shards and no live replica leads shard(s) "
                       f"{', '.join(map(str, missing))}{tail}")
    best = next((r for r in live if r in found.leaders), live[0])
    age = (now - best.last_seen).total_seconds()
    detail = f"{best.name} is {best.state}"
    engines = [r for r in found.leaders if matches(r) and r.shard is not None]
    if engines:  # sharded replicas: what each one's engines lead, named by the replica that leads them
        detail = "; ".join(
            f"{replica} leads shard(s) {', '.join(str(r.shard) for r in led)} of {led[0].shards} "
            f"({rate_text(sum(r.throughput for r in led))} records/s, {sum(r.in_flight for r in led):,} in flight)"
            for replica, led in _by_replica(engines))
    elif best in found.leaders:
        detail += f" ({rate_text(best.throughput)} records/s, {best.in_flight:,} in flight)"
    return True, f"{detail}, seen {age:.1f}s ago; {_processes(live)} live replica(s) for {scope}{tail}"


#: How much earlier than a newer leader's `since` (its host's clock) another leader's `last_seen` (the database's)
#: must be for that leader to count as superseded: room for the clocks' skew.
SUPERSEDED_SLACK = 1.0


def _superseded(leaders: list[Any]) -> list[Any]:
    """The leaders' rows last written before another replica became leader of the same group, shard and table
    (more than SUPERSEDED_SLACK before its row's `since`). A leader writes its row every `status_interval` while it
    lives, so one that has not written since is dead or frozen (and fenced out): counted as leading until
    `status_gone_after`, it would be a second leader for that long after every crash. One that writes again is a
    leader again, and two leaders are said as such."""
    by_place: dict[tuple[str, str, int | None], list[Any]] = {}
    for r in leaders:
        by_place.setdefault((r.leader_group, r.harvested_table, r.shard), []).append(r)
    return [r for rows in by_place.values() for r in rows
            if any((other.since - r.last_seen).total_seconds() > SUPERSEDED_SLACK for other in rows if other is not r)]


def _processes(rows: list[Any]) -> int:
    """How many replicas (processes) the rows are of: a sharded replica writes a row per shard engine beside its
    own, a process harvesting several outboxes a row per outbox's engine (`replica-a/shop`)."""
    return len({(sharding.replica_of(r.name, r.shard) if r.shard is not None else r.name).partition("/")[0]
                for r in rows})


def _by_replica(engines: list[Any]) -> list[tuple[str, list[Any]]]:
    """Shard engines' rows grouped by the replica each belongs to (its name without the shard's suffix),
    the replicas in name order and each one's shards in order."""
    grouped: dict[str, list[Any]] = {}
    for row in sorted(engines, key=lambda r: (r.leader_group, r.shard)):
        grouped.setdefault(sharding.replica_of(row.name, row.shard), []).append(row)
    return sorted(grouped.items())


#: Columns later migrations added to the status table, as an older table's rows read without them.
LATER_COLUMNS = {"blocked_by": None, "held": [], "queued": 0, "marked_upto": None, "shard": None, "shards": 1}


def read(conn: psycopg.Connection, status_table: str) -> tuple[list[Any], datetime]:
    """The status rows and the database's time now, for a process without Django's ORM (a table made before the
    latest migrations reads as if it had their columns' defaults)."""
    with conn.cursor(row_factory=dict_row) as cursor:
        rows = cursor.execute(sql.SQL("SELECT * FROM {} ORDER BY name").format(
            table_identifier(status_table))).fetchall()
    return ([SimpleNamespace(**{**LATER_COLUMNS, **row}) for row in rows],
            conn.execute("SELECT statement_timestamp()").fetchone()[0])
