"""What harvesting cost the database over a span of the dashboard, by kind of statement.

From the history samples (outbox.console.history reads them in buckets): the server's own time for the
table's statements, as the leaders read it from pg_stat_statements (outbox.harvest.dbtime), and every
replica's round trips, timed by the engine. Totals are cumulative, so the span's figures are the
sums of their increases between consecutive buckets; a total that went down (a restart, a reset of
pg_stat_statements) or a long gap breaks the line and adds nothing.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING

from outbox.console.charts import MAX_SERIES, Chart, Marker, Series
from outbox.harvest.dbtime import KINDS, LABELS

if TYPE_CHECKING:
    from outbox.console.history import Point

#: A break in the samples longer than this many buckets is not bridged.
GAP_BUCKETS = 3
SERVER_CHART = "Database time by statement"
ROUND_TRIPS_CHART = "Round trips by statement, time waited"
#: Kinds that travel in the mark's round trip (pipelined with it).
IN_THE_MARKS = ("gaps", "writers")


@dataclass(frozen=True)
class KindCost:
    """One kind of statement over the span."""

    kind: str
    #: The server's execution time and executions (None: no pg_stat_statements figures in the span).
    server_seconds: float | None
    executions: int | None
    #: The replicas' round trips of this kind and the time they waited (None: not a kind of round trip).
    round_trips: int | None
    waited_seconds: float | None
    #: Its part of the server's time of all kinds, and its server time per published record.
    share: float | None = None
    per_record: float | None = None

    @property
    def label(self) -> str:
        return LABELS.get(self.kind, self.kind)

    @property
    def mean_round_trip(self) -> float | None:
        return self.waited_seconds / self.round_trips if self.round_trips else None

    @property
    def server_text(self) -> str:
        return duration(self.server_seconds)

    @property
    def per_record_text(self) -> str:
        return duration(self.per_record)

    @property
    def share_text(self) -> str:
        return "" if self.share is None else f"{100 * self.share:.0f}%" if self.share >= 0.01 else "<1%"

    @property
    def executions_text(self) -> str:
        return "" if self.executions is None else f"{self.executions:,}"

    @property
    def round_trips_text(self) -> str:
        if self.round_trips is not None:
            return f"{self.round_trips:,}"
        return "in the mark's" if self.kind in IN_THE_MARKS else ""

    @property
    def mean_round_trip_text(self) -> str:
        return duration(self.mean_round_trip)


@dataclass(frozen=True)
class Cost:
    """The span's charts (server time and round trips, per kind) and its totals."""

    charts: list[Chart]
    kinds: list[KindCost]
    published: int
    server_seconds: float | None
    waited_seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def has_server(self) -> bool:
        return self.server_seconds is not None

    @property
    def per_record(self) -> float | None:
        """Server seconds per published record."""
        return self.server_seconds / self.published if self.server_seconds is not None and self.published else None

    @property
    def server_text(self) -> str:
        return duration(self.server_seconds)

    @property
    def per_record_text(self) -> str:
        return duration(self.per_record)

    @property
    def published_text(self) -> str:
        return f"{self.published:,}"

    @property
    def waited_text(self) -> str:
        return duration(self.waited_seconds)


def duration(seconds: float | None) -> str:
    """A span of time as people read it: µs, ms, s or min, three figures at most."""
    if seconds is None:
        return ""
    if seconds == 0:
        return "0"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    if seconds < 1e-8:
        return "<0.01 µs"
    for scale, unit in ((1, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if seconds >= scale or unit == "µs":
            value = seconds / scale
            return f"{value:.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"
    return ""  # pragma: no cover - the loop always returns


def read(begin: float, finish: float, bucket: float, replicas: Mapping[str, Sequence[Point]],
         server: Sequence[tuple[float, Mapping[str, list[float]]]], markers: list[Marker]) -> Cost:
    """The span's cost from the replicas' points (with their round trips) and the table's server totals
    (time of the read, totals by kind), both in time order."""
    longest = GAP_BUCKETS * bucket
    server_rates, server_sums = _server(server, longest)
    trip_rates: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    trips: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    published = sum(point.grew for points in replicas.values() for point in points)
    for points in replicas.values():
        for before, after in pairwise(points):
            elapsed = after.at - before.at
            if elapsed <= 0 or elapsed > longest:
                continue
            old, new = before.round_trips or {}, after.round_trips or {}
            if after.round_trips is None or any(new.get(k, [0, 0.0])[1] < v[1] for k, v in old.items()):
                continue  # restarted, or no figures
            for kind, (count, seconds, *_rest) in new.items():
                was = old.get(kind, [0, 0.0])
                trips[kind][0] += count - was[0]
                trips[kind][1] += seconds - was[1]
                # Summed over the replicas by bucket (their samples are not taken at the same moments).
                slot = math.floor(after.at / bucket) * bucket
                trip_rates[kind][slot] += (seconds - was[1]) / elapsed * 1000
    server_total = sum(seconds for _, seconds in server_sums.values()) if server_sums else None
    kinds = []
    for kind in KINDS:
        server_s = server_sums.get(kind, (0, 0.0))[1] if server_sums else None
        executions = server_sums.get(kind, (0, 0.0))[0] if server_sums else None
        count, waited = trips.get(kind, (0, 0.0))
        if not server_s and not executions and not count:
            continue
        kinds.append(KindCost(kind, server_s, executions, int(count) if kind in trips else None,
                              waited if kind in trips else None,
                              share=server_s / server_total if server_s is not None and server_total else None,
                              per_record=server_s / published if server_s is not None and published else None))
    kinds.sort(key=lambda k: -(k.server_seconds if k.server_seconds is not None else k.waited_seconds or 0.0))
    charts, notes = [], []
    if server_sums:
        charts.append(_chart(SERVER_CHART, begin, finish, server_rates,
                             server_sums, markers))
    else:
        notes.append("The server's own time per statement needs pg_stat_statements in this database (loaded by "
                     "shared_preload_libraries, then CREATE EXTENSION pg_stat_statements); the round trips below "
                     "are the harvesters' own measure, network included.")
    trip_sums = {kind: (int(count), seconds) for kind, (count, seconds) in trips.items()}
    charts.append(_chart(ROUND_TRIPS_CHART, begin, finish,
                         {kind: _bucketed(rates, bucket, finish) for kind, rates in trip_rates.items()}, trip_sums,
                         markers))
    waited = sum(seconds for _, seconds in trips.values())
    return Cost(charts, kinds, published, server_total, waited, notes)


def _bucketed(rates: Mapping[float, float], bucket: float, finish: float) -> list[tuple[float, float | None]]:
    """(bucket's end, rate) in time order, broken where buckets are missing for a while."""
    points: list[tuple[float, float | None]] = []
    previous = None
    for slot in sorted(rates):
        if previous is not None and slot - previous > GAP_BUCKETS * bucket:
            points.append((previous + bucket, None))
        points.append((min(slot + bucket, finish), rates[slot]))
        previous = slot
    return points


def _server(totals: Sequence[tuple[float, Mapping[str, list[float]]]], longest: float
            ) -> tuple[dict[str, list[tuple[float, float | None]]], dict[str, tuple[int, float]]]:
    """Per kind: its rate (ms per second) between consecutive reads, and its increase over the span."""
    rates: dict[str, list[tuple[float, float | None]]] = defaultdict(list)
    sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for (before_at, before), (at, after) in pairwise(totals):
        elapsed = at - before_at
        went_down = any(after.get(kind, [0, 0.0])[1] < value[1] for kind, value in before.items())
        for kind in set(before) | set(after):
            if elapsed <= 0 or elapsed > longest or went_down:
                rates[kind].append((at, None))
                continue
            calls, seconds = after.get(kind, [0, 0.0])[:2]
            was_calls, was_seconds = before.get(kind, [0, 0.0])[:2]
            sums[kind][0] += calls - was_calls
            sums[kind][1] += seconds - was_seconds
            rates[kind].append((at, (seconds - was_seconds) / elapsed * 1000))
    return rates, {kind: (int(calls), seconds) for kind, (calls, seconds) in sums.items()}


def _chart(title: str, begin: float, finish: float, rates: Mapping[str, list[tuple[float, float | None]]],
           sums: Mapping[str, tuple[int, float]], markers: list[Marker]) -> Chart:
    """A line per kind, the most expensive first; the rest named in a note."""
    ranked = [kind for kind in sorted(sums, key=lambda k: -sums[k][1]) if sums[kind][1] > 0]
    shown = ranked[:MAX_SERIES]
    note = f"Not drawn: {', '.join(LABELS.get(k, k) for k in ranked[MAX_SERIES:])}." if len(ranked) > MAX_SERIES \
        else ""
    return Chart(title, "ms_per_s", begin, finish, [Series(LABELS.get(k, k), list(rates[k])) for k in shown],
                 markers, note)
