"""What the admin dashboard shows, read with queries that stay fast on a table of millions of rows.

No COUNT(*) of the outbox: the backlog is Postgres's own live-row estimate, in-flight counts
come from the replicas' status rows, and stuck records are looked for among the oldest rows
(the primary key's head) and through the partial index of rows that ever failed.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import connections
from django.utils import timezone

from outbox import conf
from outbox.models import HarvesterStatus, OutboxRecord

#: Stuck records are looked for among this many of the oldest rows (an index range, not a scan).
HEAD_ROWS = 10_000
#: At most this many stuck records are listed.
STUCK_LIMIT = 100


@dataclass
class Replicas:
    leaders: list[HarvesterStatus]
    standbys: list[HarvesterStatus]
    gone: list[HarvesterStatus]

    @property
    def live(self) -> list[HarvesterStatus]:
        return self.leaders + self.standbys

    @property
    def live_leader_ids(self) -> list[uuid.UUID]:
        return [r.leader_id for r in self.live if r.leader_id is not None]


@dataclass
class Backlog:
    estimated_rows: int | None
    in_flight: int
    oldest_created: datetime | None

    @property
    def pending(self) -> int | None:
        return None if self.estimated_rows is None else max(0, self.estimated_rows - self.in_flight)

    @property
    def oldest_age(self) -> timedelta | None:
        return None if self.oldest_created is None else timezone.now() - self.oldest_created


@dataclass
class StuckRecord:
    id: int
    topic: str
    key: str
    created: datetime
    leader_id: uuid.UUID | None
    reset_count: int
    last_error: str | None
    reasons: list[str] = field(default_factory=list)

    @property
    def age(self) -> timedelta:
        return timezone.now() - self.created


def replicas(now: datetime | None = None) -> Replicas:
    now = now or timezone.now()
    gone_after = timedelta(seconds=conf.setting("status_gone_after"))
    rows = list(HarvesterStatus.objects.order_by("name"))
    live = [r for r in rows if now - r.last_seen <= gone_after]
    return Replicas(
        leaders=[r for r in live if r.state == "leader"],
        standbys=[r for r in live if r.state != "leader"],
        gone=[r for r in rows if now - r.last_seen > gone_after],
    )


def backlog(found: Replicas) -> Backlog:
    table = OutboxRecord._meta.db_table
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = to_regclass(%s)", [table])
        row = cursor.fetchone()
    oldest = OutboxRecord.objects.order_by("id").values_list("create_time", flat=True).first()
    in_flight = sum(r.in_flight for r in found.leaders)
    return Backlog(estimated_rows=int(row[0]) if row else None, in_flight=in_flight, oldest_created=oldest)


def stuck_records(found: Replicas) -> list[StuckRecord]:
    """Rows marked by a leader id no live replica holds, pending too long, or reset too often."""
    stuck_after = conf.setting("stuck_after")
    reset_limit = conf.setting("stuck_reset_count")
    live = found.live_leader_ids
    table = connections["default"].ops.quote_name(OutboxRecord._meta.db_table)
    columns = "id, kafka_topic, kafka_key, create_time, leader_id, reset_count, last_error"
    query = f"""
        (WITH head AS (SELECT {columns} FROM {table} ORDER BY id LIMIT %(head)s)
         SELECT {columns} FROM head
         WHERE (leader_id IS NOT NULL AND NOT (leader_id = ANY(%(live)s::uuid[])))
            OR create_time < now() - make_interval(secs => %(after)s)
         ORDER BY id LIMIT %(limit)s)
        UNION
        (SELECT {columns} FROM {table} WHERE reset_count > 0 AND reset_count >= %(resets)s ORDER BY id LIMIT %(limit)s)
        ORDER BY id LIMIT %(limit)s
    """
    with connections["default"].cursor() as cursor:
        cursor.execute(query, {"head": HEAD_ROWS, "live": live, "after": stuck_after, "resets": reset_limit,
                               "limit": STUCK_LIMIT})
        rows = cursor.fetchall()
    now = timezone.now()
    result = []
    for row_id, topic, key, created, leader_id, reset_count, last_error in rows:
        record = StuckRecord(row_id, topic, key, created, leader_id, reset_count, last_error)
        if leader_id is not None and leader_id not in live:
            record.reasons.append(f"marked by leader id {leader_id}, which no live replica holds")
        if now - created > timedelta(seconds=stuck_after):
            record.reasons.append(f"pending for more than {timedelta(seconds=int(stuck_after))}")
        if reset_count >= reset_limit:
            error = f": {last_error}" if last_error else ""
            record.reasons.append(f"delivery failed {reset_count} times{error}")
        result.append(record)
    return result


def warnings(found: Replicas) -> list[str]:
    if not found.live:
        return ["No harvester is running: nothing is being published."]
    if not found.leaders:
        return ["No replica leads: nothing is being published (an election may be under way)."]
    by_group: dict[str, list[str]] = {}
    for leader in found.leaders:
        by_group.setdefault(leader.leader_group, []).append(leader.name)
    return [f"More than one replica claims to lead group {group!r} ({', '.join(names)}): until one gives way, "
            f"per-key order is at risk." for group, names in by_group.items() if len(names) > 1]
