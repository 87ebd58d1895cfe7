"""The dashboard's charts, read from the replicas' history samples (outbox_harvester_history).

Each replica's status reporter adds a sample every `history_interval` seconds (outbox.harvest.status).
One grouped query reads a span into at most MAX_POINTS buckets per replica, so the cost of a page
does not grow with the sampling rate or the span: rates are the differences of the replicas' totals
between buckets; the backlog and the oldest row's age are the table's, whichever replica saw them;
a replica's `since` while it led is the moment it took the lead.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from itertools import pairwise

from django.db import connections
from django.utils import timezone

from outbox.charts import MAX_SERIES, Chart, Marker, Series
from outbox.models import HarvesterSample

#: The spans offered, by their query value.
SPANS = {"1h": timedelta(hours=1), "6h": timedelta(hours=6), "24h": timedelta(hours=24)}
SPAN_LABELS = {"1h": "hour", "6h": "6 hours", "24h": "24 hours"}
DEFAULT_SPAN = "1h"
#: A span is read into at most this many buckets per replica: about 3 pixels each on a chart, 20 s each
#: over an hour. More would cost the page time and show nothing more.
MAX_POINTS = 180
#: A bucket never spans less than this (samples are 10 s apart by default).
MIN_BUCKET = 10.0

# One query for the whole span: per replica and bucket its figures, and when it took the lead (a leader's
# `since`; the first and the last, should it have taken the lead twice within one bucket).
BUCKETS = """
SELECT name, harvested_table, floor(extract(epoch FROM at) / %(bucket)s) AS bucket,
       max(extract(epoch FROM at)), max(published), max(failed), max(in_flight), max(backlog), max(oldest_age),
       extract(epoch FROM min(since) FILTER (WHERE state = 'leader')),
       extract(epoch FROM max(since) FILTER (WHERE state = 'leader'))
FROM {table} WHERE at >= %(start)s
GROUP BY name, harvested_table, bucket ORDER BY name, bucket
"""


@dataclass(frozen=True)
class Point:
    at: float
    published: int
    failed: int
    in_flight: int
    backlog: int | None
    oldest_age: float | None


@dataclass(frozen=True)
class History:
    """The charts of one span, and the moments the lead moved."""

    span: str
    start: datetime
    end: datetime
    charts: list[Chart]
    takeovers: list[Marker]

    @property
    def span_label(self) -> str:
        return SPAN_LABELS[self.span]


def span_of(value: str | None) -> str:
    return value if value in SPANS else DEFAULT_SPAN


def read(span: str = DEFAULT_SPAN, using: str = "default", now: datetime | None = None) -> History:
    span = span_of(span)
    end = now or timezone.now()
    start = end - SPANS[span]
    bucket = max(MIN_BUCKET, SPANS[span].total_seconds() / MAX_POINTS)
    table = connections[using].ops.quote_name(HarvesterSample._meta.db_table)
    replicas: dict[str, list[Point]] = defaultdict(list)
    tables: dict[str, dict[float, Point]] = defaultdict(dict)
    took_lead: set[tuple[float, str]] = set()
    begin, finish = start.timestamp(), end.timestamp()
    with connections[using].cursor() as cursor:
        cursor.execute(BUCKETS.format(table=table), {"bucket": bucket, "start": start})
        rows = cursor.fetchall()
        for name, harvested, number, at, published, failed, in_flight, backlog, oldest, first, last in rows:
            took_lead |= {(float(since), name) for since in (first, last) if since is not None and since >= begin}
            point = Point(float(at), int(published), int(failed), int(in_flight),
                          None if backlog is None else int(backlog), oldest)
            replicas[name].append(point)
            slot = float(number) * bucket
            seen = tables[harvested].get(slot)
            # The table's figures: the latest any replica saw in the bucket.
            if seen is None or point.at > seen.at:
                tables[harvested][slot] = point
    takeovers = [Marker(since, f"{name} took the lead") for since, name in sorted(took_lead)]
    shown = sorted(replicas, key=lambda n: replicas[n][-1].at, reverse=True)[:MAX_SERIES]
    left_out = len(replicas) - len(shown)
    note = f"{left_out} replica(s) seen earlier in this span are not drawn." if left_out else ""
    shown.sort()

    def per_replica(title: str, unit: str, value) -> Chart:
        return Chart(title, unit, begin, finish, [Series(n, value(replicas[n], bucket)) for n in shown], takeovers,
                     note)

    def per_table(title: str, unit: str, value) -> Chart:
        series = [Series(t, [(p.at, value(p)) for _, p in sorted(tables[t].items())]) for t in sorted(tables)]
        return Chart(title, unit, begin, finish, series, takeovers)

    charts = [
        per_replica("Records published per second", "rate", lambda points, b: _rates(points, b, "published")),
        per_replica("Deliveries failed per second", "rate", lambda points, b: _rates(points, b, "failed")),
        per_table("Rows in the outbox", "count", lambda p: p.backlog),
        per_table("Age of the oldest row", "seconds", lambda p: p.oldest_age or (0.0 if p.backlog == 0 else None)),
        per_replica("Records in flight", "count", lambda points, b: _gapped(points, b, lambda p: p.in_flight)),
    ]
    return History(span, start, end, charts, takeovers)


def _gapped(points: list[Point], bucket: float, value) -> list[tuple[float, float | None]]:
    """(time, value) per point, with a break where the replica was not sampled for a while."""
    result: list[tuple[float, float | None]] = []
    for before, point in zip([None, *points], points, strict=False):
        if before is not None and point.at - before.at > 3 * bucket:
            result.append((before.at + bucket, None))
        result.append((point.at, value(point)))
    return result


def _rates(points: list[Point], bucket: float, total: str) -> list[tuple[float, float | None]]:
    """Per second between consecutive points; a break across a gap or a restart (its total went down)."""
    totals = [(p.at, getattr(p, total)) for p in points]
    result: list[tuple[float, float | None]] = []
    for (before_at, before), (at, now) in pairwise(totals):
        elapsed, grown = at - before_at, now - before
        result.append((at, None if elapsed > 3 * bucket or grown < 0 or elapsed <= 0 else grown / elapsed))
    return result
