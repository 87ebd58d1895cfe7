"""History samples of replicas that are not running, as a status reporter writes them (outbox_harvester_history)."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from django.utils import timezone

from outbox.models import HarvesterSample


def samples(name: str, *, minutes: float = 60, every: float = 10, rate: float = 100.0, leading_from: float = 0,
            table: str = "outbox", group: str = "g", backlog: int = 500, oldest_age: float = 30.0,
            failed_rate: float = 0.0, now: datetime | None = None,
            round_trips: dict[str, tuple[float, float]] | None = None,
            statements: dict[str, tuple[float, float]] | None = None) -> list[HarvesterSample]:
    """A replica's samples over the last `minutes`, one every `every` seconds: leading from `leading_from` minutes
    ago (0: standing by throughout) until now, and publishing `rate` records/s while it leads. `round_trips` and
    `statements` give, per kind of statement, (count, seconds) per second while it leads: its round trips, and the
    server's time it reads from pg_stat_statements (only a leader does)."""
    now = now or timezone.now()
    count = int(minutes * 60 / every)
    took_lead = now - timedelta(minutes=leading_from) if leading_from else None
    leader_id = uuid.uuid4()
    rows, published, failed, elapsed = [], 0, 0, 0.0
    for i in range(count):
        at = now - timedelta(seconds=(count - 1 - i) * every)
        leading = took_lead is not None and at >= took_lead
        if leading and i:
            published, failed = published + int(every * rate), failed + int(every * failed_rate)
            elapsed += every
        rows.append(HarvesterSample(
            name=name, at=at, state="leader" if leading else "standby", leader_id=leader_id if leading else None,
            since=took_lead if leading else now - timedelta(hours=2), harvested_table=table, leader_group=group,
            published=published, failed=failed, in_flight=40 if leading else 0,
            queued=0, held=0, backlog=backlog, oldest_age=oldest_age,
            db_round_trips=_totals(round_trips, elapsed),
            db_statements=_totals(statements, elapsed) if leading else None))
    return HarvesterSample.objects.bulk_create(rows)


def _totals(per_second: dict[str, tuple[float, float]] | None, elapsed: float) -> dict[str, list[float]] | None:
    """Cumulative [count, seconds, rows] per kind after `elapsed` seconds at the given rates."""
    if per_second is None:
        return None
    return {kind: [int(count * elapsed), seconds * elapsed, 0] for kind, (count, seconds) in per_second.items()}
