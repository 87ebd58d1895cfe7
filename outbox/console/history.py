"""The dashboard's charts, read from the replicas' history samples (outbox_harvester_history).

Each replica's status reporter adds a sample every `history_interval` seconds (outbox.harvest.status).
One grouped query reads a span into at most MAX_POINTS buckets per replica, so the cost of a page
does not grow with the sampling rate or the span: rates are the differences of the replicas' totals
between buckets; the backlog and the oldest row's age are the table's, whichever replica saw them;
a replica's `since` while it led is the moment it took the lead. What harvesting cost the database
(outbox.console.database_cost) is read from the same buckets.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from itertools import pairwise
from typing import Any

from django.db import connections
from django.utils import timezone

from outbox import conf
from outbox.console import database_cost
from outbox.console.charts import MAX_SERIES, Chart, Marker, Series, clock
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
#: When the first sample is later than this share of the span, the charts start at it (a young system's data
#: would be a sliver at the right edge).
YOUNG = 0.2
#: A replica sampled within this many seconds (or three buckets) is running: drawn as a line of its own.
RUNNING_WITHIN = 30.0
#: Lead changes closer than the span over this are one mark (about 9 pixels apart on a chart).
MARKS_APART = 60

# One query for the whole span: per replica and bucket its figures, and when it took the lead (a leader's
# `since`; the first and the last, should it have taken the lead twice within one bucket).
BUCKETS = """
WITH sampled AS (
  SELECT name, harvested_table, at, published, failed, in_flight, backlog, oldest_age, since, state, db_round_trips,
         db_statements, published - lag(published) OVER (PARTITION BY name, harvested_table ORDER BY at) AS grew
  FROM {table} WHERE at >= %(start)s
)
SELECT name, harvested_table, floor(extract(epoch FROM at) / %(bucket)s) AS bucket,
       max(extract(epoch FROM at)), max(published), max(failed), max(in_flight), max(backlog), max(oldest_age),
       extract(epoch FROM min(since) FILTER (WHERE state = 'leader')),
       extract(epoch FROM max(since) FILTER (WHERE state = 'leader')),
       (array_agg(db_round_trips ORDER BY at DESC) FILTER (WHERE db_round_trips IS NOT NULL))[1],
       (array_agg(jsonb_build_array(extract(epoch FROM at), db_statements) ORDER BY at DESC)
          FILTER (WHERE db_statements IS NOT NULL))[1],
       coalesce(sum(CASE WHEN grew < 0 THEN published ELSE grew END), 0)
FROM sampled
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
    #: The replica's database round trips so far, by kind (dbtime.Totals as JSON), if the sample has them.
    round_trips: dict | None = None
    #: Records it published since its sample before this bucket's first, summed over the bucket's samples (a sample
    #: whose total went down follows a restart: its whole total counts). The bucket's `published` is its largest
    #: total, so the span's records are these, not the differences between buckets: a replica whose samples all
    #: fall in one bucket published records too.
    grew: int = 0


@dataclass(frozen=True)
class History:
    """The charts of one span, and the moments the lead moved."""

    span: str
    start: datetime
    end: datetime
    charts: list[Chart]
    takeovers: list[Marker]
    #: What harvesting cost the database in the span, by kind of statement.
    cost: database_cost.Cost | None = None
    #: Said above the charts: that their time axis starts at the first sample, on a system younger than the span.
    note: str = ""

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
    statements: dict[str, dict[float, tuple[float, dict]]] = defaultdict(dict)
    took_lead: set[tuple[float, str]] = set()
    begin, finish = start.timestamp(), end.timestamp()
    with connections[using].cursor() as cursor:
        cursor.execute(BUCKETS.format(table=table), {"bucket": bucket, "start": start})
        rows = cursor.fetchall()
        for (name, harvested, number, at, published, failed, in_flight, backlog, oldest, first, last, round_trips,
             server, grew) in rows:
            took_lead |= {(float(since), name) for since in (first, last) if since is not None and since >= begin}
            point = Point(float(at), int(published), int(failed), int(in_flight),
                          None if backlog is None else int(backlog), oldest, _json(round_trips), int(grew))
            replicas[name].append(point)
            slot = float(number) * bucket
            seen = tables[harvested].get(slot)
            # The table's figures: the latest any replica saw in the bucket.
            if seen is None or point.at > seen.at:
                tables[harvested][slot] = point
            if server is not None:  # the server's totals for the table, as its leader read them last
                read_at, totals = _json(server)
                kept = statements[harvested].get(slot)
                if kept is None or read_at > kept[0]:
                    statements[harvested][slot] = (float(read_at), totals)
    first = min((points[0].at for points in replicas.values()), default=None)
    note = ""
    if first is not None and first - begin > YOUNG * (finish - begin):  # a system younger than the span
        begin = max(begin, first - max(2 * bucket, 0.05 * (finish - first)))
        note = f"The first sample of this span is from {clock(first)}: the charts start there."
    takeovers = lead_changes(sorted(took_lead), within=(finish - begin) / MARKS_APART)
    # Replicas not sampled lately (stopped, gone, or renamed by a restart) are drawn as one line, summed; so are
    # the least recent live ones beyond MAX_SERIES - 1 lines.
    running = sorted((n for n in replicas if replicas[n][-1].at >= finish - max(3 * bucket, RUNNING_WITHIN)),
                     key=lambda n: replicas[n][-1].at, reverse=True)
    shown = sorted(running[:MAX_SERIES - 1] if len(replicas) > len(running) else running[:MAX_SERIES])
    earlier = sorted(set(replicas) - set(shown))
    earlier_label = f"{len(earlier)} replica{'s' if len(earlier) > 1 else ''} not running now"
    replica_note = f"{earlier_label} (one line, summed): {', '.join(earlier)}." if len(earlier) > 1 else ""

    def per_replica(title: str, unit: str, value) -> Chart:
        series = [Series(n, value(replicas[n], bucket)) for n in shown]
        if len(earlier) == 1:
            series.append(Series(earlier[0], value(replicas[earlier[0]], bucket)))
        elif earlier:
            series.append(Series(earlier_label, _summed([value(replicas[n], bucket) for n in earlier], bucket)))
        return Chart(title, unit, begin, finish, series, takeovers, replica_note)

    def per_table(title: str, unit: str, value) -> Chart:
        series = [Series(t, [(p.at, value(p)) for _, p in sorted(tables[t].items()) if p.at >= begin])
                  for t in sorted(tables)]
        return Chart(title, unit, begin, finish, series, takeovers)

    charts = [
        per_replica("Records published per second", "rate", lambda points, b: _rates(points, b, "published")),
        per_replica("Deliveries failed per second", "rate", lambda points, b: _rates(points, b, "failed")),
        per_table("Rows in the outbox", "count", lambda p: p.backlog),
        per_table("Age of the oldest row", "seconds", lambda p: p.oldest_age or (0.0 if p.backlog == 0 else None)),
        per_replica("Records in flight", "count", lambda points, b: _gapped(points, b, lambda p: p.in_flight)),
    ]
    # The server's totals of one table (statements that do not name their table, the fence's and the
    # writers', are counted alike by every table's leader): the dashboard's own, or the busiest.
    own = conf.setting("table")
    chosen = own if own in statements else max(statements, key=lambda t: len(statements[t]), default=None)
    server = [value for _, value in sorted(statements[chosen].items())] if chosen else []
    cost = database_cost.read(begin, finish, bucket, replicas, server, takeovers)  # every replica's, drawn or not
    return History(span, start, end, charts, takeovers, cost, note)


def lead_changes(took_lead: list[tuple[float, str]], within: float) -> list[Marker]:
    """The moments replicas took the lead, as marks: those less than `within` seconds after the one before are one
    mark that counts them (on a young system, or one restarting its replicas, they would stand as a wall)."""
    groups: list[list[tuple[float, str]]] = []
    for moment in took_lead:
        if groups and moment[0] - groups[-1][-1][0] < within:
            groups[-1].append(moment)
        else:
            groups.append([moment])
    marks = []
    for group in groups:
        if len(group) == 1:
            marks.append(Marker(group[0][0], f"{group[0][1]} took the lead"))
        else:
            names = ", ".join(name for _, name in group)
            marks.append(Marker(group[0][0], f"{len(group)} lead changes: {names} took the lead in turn",
                                until=group[-1][0]))
    return marks


def _summed(lines: list[list[tuple[float, float | None]]], bucket: float) -> list[tuple[float, float | None]]:
    """Several replicas' lines as one: per bucket the sum of the values there (a bucket where none has a value
    breaks the line)."""
    slots: dict[float, float | None] = {}
    for line in lines:
        for at, value in line:
            slot = at // bucket * bucket
            if value is not None:
                slots[slot] = (slots.get(slot) or 0.0) + value
            else:
                slots.setdefault(slot, None)
    return sorted(slots.items())


def _json(value: Any) -> Any:
    """A jsonb value as Django's cursor gives it (text), decoded."""
    return json.loads(value) if isinstance(value, str | bytes) else value


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
