"""Running many seeds of a simulator in fresh processes, for the tests of both simulators."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import pytest

#: A simulator run over many seeds is split into this many tests, each seed in one: none takes a minute, and
#: pytest-xdist spreads them over its workers.
PARTS = 4


def seeds_of_part(seeds: list[int], part: int) -> list[int]:
    """Every PARTS-th seed from the `part`-th on (a run's cost does not follow its seed); a part left without one
    (--sim-seed runs one seed) is skipped."""
    chosen = seeds[part::PARTS]
    if not chosen:
        pytest.skip("no seed in this part (--sim-seed runs one)")
    return chosen


def assert_every_seed_passes(run_quietly: Callable[[int], tuple[int, str | None, str]], seeds: list[int],
                             test_file: str) -> None:
    """Run `run_quietly` over the seeds on every core; fail listing the first ten broken ones with their replay."""
    workers = min(len(seeds), os.cpu_count() or 1)
    # Fresh processes ("spawn"): forking a test process that has threads running is not safe.
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(run_quietly, seeds, chunksize=max(1, len(seeds) // (workers * 8))))
    failures = [(seed, violation, summary) for seed, violation, summary in results if violation]
    report = "\n".join(f"{summary}\n    {violation}\n    replay: pytest {test_file} --sim-seed {seed}"
                       for seed, violation, summary in failures[:10])
    assert not failures, f"{len(failures)} of {len(seeds)} seeds broke an invariant:\n{report}"
