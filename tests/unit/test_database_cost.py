"""outbox.console.database_cost: what harvesting cost the database over a span, from the samples' cumulative totals."""

from __future__ import annotations

import pytest

from outbox.console.database_cost import duration, read
from outbox.console.history import Point

START = 1_800_000_000.0
BUCKET = 20.0


def point(at: float, published: int, trips: dict[str, list[float]] | None, grew: int = 0) -> Point:
    return Point(START + at, published, 0, 0, 0, 0.0, trips, grew)


def series(*samples: tuple[float, int, dict[str, list[float]] | None]) -> list[Point]:
    """A replica's points, one sample a bucket, each with what it published since the one before as history.BUCKETS
    reads it (a total that went down follows a restart: all of it counts)."""
    found, last = [], None
    for at, published, trips in samples:
        grew = 0 if last is None else published if published < last else published - last
        found.append(point(at, published, trips, grew))
        last = published
    return found


def test_the_spans_figures_are_the_increases_of_the_totals_per_kind_and_per_record():
    # 1,000 records/s for 60 s; the server spent 10 ms/s marking and 30 ms/s purging.
    server = [(START + t, {"mark": [t * 10, t * 0.010, t * 500], "purge": [t * 50, t * 0.030, t * 50],
                           "writers": [t * 10, t * 0.002, 0]}) for t in (0, 20, 40, 60)]
    replica = series(*((t, t * 1000, {"mark": [t * 10, t * 0.020, t * 1000], "purge": [t * 50, t * 0.050, t * 1000]})
                       for t in (0, 20, 40, 60)))
    cost = read(START, START + 60, BUCKET, {"r": replica}, server, [])
    assert cost.published == 60_000
    assert cost.server_seconds == pytest.approx(60 * 0.042)
    assert cost.per_record == pytest.approx(60 * 0.042 / 60_000)
    purge, mark, writers = cost.kinds
    assert (purge.kind, mark.kind, writers.kind) == ("purge", "mark", "writers"), "the most expensive first"
    assert purge.server_seconds == pytest.approx(1.8) and purge.executions == 3000
    assert purge.share == pytest.approx(0.030 / 0.042)
    assert purge.round_trips == 3000 and purge.mean_round_trip == pytest.approx(0.001)
    assert writers.round_trips is None, "writers travel in the mark's round trip"
    server_chart, trips_chart = cost.charts
    assert [s.label for s in server_chart.series] == ["purge", "mark", "writers"]
    assert [v for _, v in server_chart.series[0].points] == pytest.approx([30.0, 30.0, 30.0])
    assert [s.label for s in trips_chart.series] == ["purge", "mark"]
    assert [v for _, v in trips_chart.series[0].points] == pytest.approx([50.0, 50.0, 50.0])


def test_round_trips_are_summed_over_the_replicas_by_bucket():
    a = [point(t, 0, {"purge": [0, t * 0.010, 0]}) for t in (1, 21, 41)]
    b = [point(t, 0, {"purge": [0, t * 0.005, 0]}) for t in (5, 25, 45)]
    cost = read(START, START + 60, BUCKET, {"a": a, "b": b}, [], [])
    [chart] = cost.charts
    assert [v for _, v in chart.series[0].points] == pytest.approx([15.0, 15.0])
    assert cost.waited_seconds == pytest.approx(40 * 0.015)
    assert not cost.has_server and "pg_stat_statements" in cost.notes[0]


def test_a_restart_or_a_reset_adds_nothing_and_breaks_the_line():
    server = [(START + 0, {"purge": [10, 1.0, 10]}), (START + 20, {"purge": [20, 2.0, 20]}),
              (START + 40, {"purge": [1, 0.1, 1]}),  # pg_stat_statements_reset()
              (START + 60, {"purge": [11, 1.1, 11]})]
    replica = series((0, 0, {"purge": [5, 0.5, 0]}), (20, 100, {"purge": [10, 1.0, 0]}),
                     (40, 5, {"purge": [1, 0.1, 0]}),  # restarted: its totals from zero
                     (60, 105, {"purge": [6, 0.6, 0]}))
    cost = read(START, START + 60, BUCKET, {"r": replica}, server, [])
    [purge] = cost.kinds
    assert purge.server_seconds == pytest.approx(2.0) and purge.executions == 20
    assert purge.round_trips == 10 and purge.waited_seconds == pytest.approx(1.0)
    assert cost.published == 100 + 5 + 100, "what it published since its restart counts"
    assert [v for _, v in cost.charts[0].series[0].points] == pytest.approx([50.0, None, 50.0])


def test_records_published_within_one_bucket_count():
    """A replica whose every sample falls in one bucket: its bucket's point has no point before it, yet it published
    (two replicas, each started and publishing once within the span's first bucket)."""
    a = [point(5, 1, None, grew=1)]
    b = [point(7, 1, None, grew=1), point(27, 3, None, grew=2)]
    assert read(START, START + 60, BUCKET, {"a": a, "b": b}, [], []).published == 4


def test_a_long_gap_is_not_bridged():
    server = [(START + 0, {"mark": [0, 0.0, 0]}), (START + 20, {"mark": [1, 1.0, 0]}),
              (START + 600, {"mark": [2, 2.0, 0]})]
    cost = read(START, START + 600, BUCKET, {}, server, [])
    assert cost.kinds[0].server_seconds == pytest.approx(1.0)
    assert [v for _, v in cost.charts[0].series[0].points] == [pytest.approx(50.0), None]


def test_durations_read_as_people_read_them():
    assert [duration(v) for v in (None, 0, 1e-10, 5e-8, 3.2e-6, 0.000123, 0.0123, 1.234, 45.6, 123)] == [
        "", "0", "<0.01 µs", "0.05 µs", "3.2 µs", "123 µs", "12.3 ms", "1.23 s", "45.6 s", "2.0 min"]
