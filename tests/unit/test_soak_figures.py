"""The soak's arithmetic (project/bench/soak.py): which records a minute times, and the verdict."""

from __future__ import annotations

import pytest

from project.bench.soak import Minute, latencies_ms, verdict


def test_a_window_times_only_the_records_committed_in_it_and_a_missing_one_by_its_wait_so_far():
    committed = {1: 99.0, 2: 100.0, 3: 100.5, 4: 101.0}  # id -> commit time
    appended = {1: 99.01, 2: 100.004, 4: 101.002}  # 3 never appended
    got = latencies_ms(committed, appended, since=100.0, until=101.0, wall=102.5)
    assert sorted(got) == pytest.approx([4.0, 2000.0])  # 1 is before the window (a warm-up's), 4 at its end


def test_the_warm_up_is_not_in_a_minute_whose_window_starts_at_the_first_minute():
    committed = {i: 90.0 + i / 10 for i in range(100)}  # 90.0 .. 99.9: the warm-up's
    committed.update({1000 + i: 100.0 + i / 10 for i in range(100)})  # after it
    appended = {i: when + (0.5 if i < 1000 else 0.005) for i, when in committed.items()}
    minute = Minute(1, latencies=latencies_ms(committed, appended, max(160.0 - 70, 100.0), 160.0 - 10, 160.0))
    assert len(minute.latencies) == 100 and minute.p(99) == pytest.approx(5.0)


def minutes(p99s: list[float], acked: int = 120_000, held: set[int] = frozenset(), backlog: int = 0) -> list[Minute]:
    return [Minute(i + 1, acked=acked, latencies=[p] * 100, held=i + 1 in held, backlog=backlog, size_mib=7.0,
                   rss_mib=80.0) for i, p in enumerate(p99s)]


def test_a_quiet_run_passes():
    assert verdict(minutes([12.0, 15.0, 9.0]), rate=2000, rss_start=78.0).ok


def test_a_minute_over_20_ms_fails_unless_an_old_transaction_is_held_then_100():
    assert verdict(minutes([12.0, 60.0, 9.0], held={2}), rate=2000, rss_start=78.0).ok
    failed = verdict(minutes([12.0, 60.0, 9.0]), rate=2000, rss_start=78.0)
    assert not failed.ok and failed.reasons == ["p99 60.0 ms in minute 2 (target 20)"]
    assert not verdict(minutes([12.0, 101.0, 9.0], held={2}), rate=2000, rss_start=78.0).ok


def test_a_backlog_over_two_seconds_of_writes_while_held_fails():
    failed = verdict(minutes([12.0, 12.0, 12.0], held={2}, backlog=4001), rate=2000, rss_start=78.0)
    assert failed.reasons == ["backlog 4,001 in minute 2 (target 4,000)"]


def test_throughput_drift_and_rss_growth_fail():
    run = minutes([12.0] * 6)
    for minute in run[-2:]:
        minute.acked = 100_000
    run[-1].rss_mib = 95.0
    reasons = verdict(run, rate=2000, rss_start=78.0).reasons
    assert reasons == ["throughput of the last 2 min 1,667/s vs the first 2,000/s", "harvester RSS grew 17.0 MiB"]
