"""The queue pages' charts, read from the trackers' samples (outbox_queue_history), and a share queue's consumers'.

Each tracker samples the queues of its partitions every `history_interval` seconds (a share queue has no tracker:
each of its consumers samples its queue, with the redeliveries the broker made to it). One grouped query
reads a span into buckets of at least MIN_BUCKET seconds (several samples of each tracker), so the
trackers' unaligned samples add up: a queue's messages in progress are the sum over its trackers of
each one's latest figure in the bucket, its redeliveries and dead letters the sum of each tracker's
growth since its previous bucket (a tracker that restarted counts from zero again).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from itertools import pairwise

from django.db import connections
from django.utils import timezone

from outbox.console.charts import MAX_SERIES, Chart, Series
from outbox.console.history import DEFAULT_SPAN, SPANS, span_of
from outbox.queue.models import QueueSample

#: At most this many buckets per queue and span.
MAX_POINTS = 180
#: A bucket spans at least this long: three samples of each tracker at the default interval.
MIN_BUCKET = 30.0

BUCKETS = """
SELECT queue, process, floor(extract(epoch FROM at) / %(bucket)s) AS bucket, max(extract(epoch FROM at)),
       (array_agg(in_progress ORDER BY at DESC))[1], max(redelivered), max(dead_lettered),
       min(extract(epoch FROM at)), min(redelivered), min(dead_lettered)
FROM {table} WHERE at >= %(start)s {only}
GROUP BY queue, process, bucket ORDER BY queue, process, bucket
"""


@dataclass
class QueueSeries:
    """One queue over a span: (time, value) per bucket."""

    in_progress: list[tuple[float, float | None]] = field(default_factory=list)
    redelivered: list[tuple[float, float | None]] = field(default_factory=list)
    dead_lettered: list[tuple[float, float | None]] = field(default_factory=list)


@dataclass(frozen=True)
class QueueHistory:
    span: str
    start: float
    end: float
    bucket: float
    queues: dict[str, QueueSeries]

    def charts_of(self, name: str) -> list[Chart]:
        """One queue's page: its messages in progress; its redeliveries and dead letters per minute."""
        series = self.queues.get(name, QueueSeries())
        return [Chart("Messages in progress", "count", self.start, self.end, [Series(name, series.in_progress)]),
                Chart("Redeliveries and dead letters per minute", "per_minute", self.start, self.end,
                      [Series("redelivered", series.redelivered), Series("dead-lettered", series.dead_lettered)])]

    def overview_charts(self) -> list[Chart]:
        """The queues page: every queue's messages in progress, and their redeliveries and dead letters."""
        names = sorted(self.queues)[:MAX_SERIES]
        note = f"{len(self.queues) - len(names)} more queue(s) are on their own pages." if len(self.queues) > len(
            names) else ""
        return [
            Chart("Messages in progress", "count", self.start, self.end,
                  [Series(n, self.queues[n].in_progress) for n in names], note=note),
            Chart("Redeliveries per minute", "per_minute", self.start, self.end,
                  [Series(n, self.queues[n].redelivered) for n in names], note=note),
            Chart("Dead letters per minute", "per_minute", self.start, self.end,
                  [Series(n, self.queues[n].dead_lettered) for n in names], note=note),
        ]


def read(span: str = DEFAULT_SPAN, queue: str | None = None, now: datetime | None = None,
         using: str = "default") -> QueueHistory:
    span = span_of(span)
    end = now or timezone.now()
    start = end - SPANS[span]
    bucket = max(MIN_BUCKET, SPANS[span].total_seconds() / MAX_POINTS)
    table = connections[using].ops.quote_name(QueueSample._meta.db_table)
    # queue -> bucket -> [time, in progress, redelivered, dead-lettered per minute], summed over trackers
    summed: dict[str, dict[float, list]] = defaultdict(dict)
    rows: dict[tuple[str, str], list[tuple[float, float, int, int, int]]] = defaultdict(list)
    firsts: dict[tuple[str, str], tuple[float, int, int]] = {}
    with connections[using].cursor() as cursor:
        cursor.execute(BUCKETS.format(table=table, only="AND queue = %(queue)s" if queue else ""),
                       {"bucket": bucket, "start": start, "queue": queue})
        for name, process, number, at, in_progress, redelivered, dead, first_at, first_redelivered, first_dead \
                in cursor.fetchall():
            rows[(name, process)].append((float(number) * bucket, float(at), in_progress, redelivered, dead))
            firsts.setdefault((name, process), (float(first_at), first_redelivered, first_dead))
    for (name, process), points in rows.items():
        for index, (slot, at, in_progress, redelivered, dead) in enumerate(points):
            entry = summed[name].setdefault(slot, [at, 0, None, None])
            entry[0] = max(entry[0], at)
            entry[1] += in_progress
            # The growth since the process's sample before; in its first bucket, since its first sample there (a
            # process samples at once when it starts: what it did in its first minute is counted too).
            if index == 0:
                before_at, before_redelivered, before_dead = firsts[(name, process)]
            else:
                _, before_at, _, before_redelivered, before_dead = points[index - 1]
            elapsed = at - before_at
            if 0 < elapsed <= 3 * bucket:
                entry[2] = (entry[2] or 0.0) + max(0, redelivered - before_redelivered) * 60 / elapsed
                entry[3] = (entry[3] or 0.0) + max(0, dead - before_dead) * 60 / elapsed
    queues = {}
    for name, slots in summed.items():
        series = QueueSeries()
        ordered = sorted(slots.items())
        for (before_slot, _), (slot, (at, in_progress, redelivered, dead)) in pairwise([(None, None), *ordered]):
            if before_slot is not None and slot - before_slot > 3 * bucket:  # no tracker reported: a gap
                for values in (series.in_progress, series.redelivered, series.dead_lettered):
                    values.append((before_slot + bucket, None))
            series.in_progress.append((at, in_progress))
            series.redelivered.append((at, redelivered))
            series.dead_lettered.append((at, dead))
        queues[name] = series
    return QueueHistory(span, start.timestamp(), end.timestamp(), bucket, queues)
