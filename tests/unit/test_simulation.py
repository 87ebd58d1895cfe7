"""The core in a simulated world: thousands of seeded runs, faults included, then the invariants.

`pytest --sim-seeds 20000` runs more; `pytest --sim-seed 1234` replays one, printing its trace.
See docs/simulation.md for what is simulated and what each check means.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.sim import mutations, scenario


def test_every_seed_keeps_the_invariants(sim_seeds):
    workers = min(len(sim_seeds), os.cpu_count() or 1)
    # Fresh processes ("spawn"): forking a test process that has threads running is not safe.
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(scenario.run_quietly, sim_seeds,
                                chunksize=max(1, len(sim_seeds) // (workers * 8))))
    failures = [(seed, violation, summary) for seed, violation, summary in results if violation]
    report = "\n".join(f"{summary}\n    {violation}\n    replay: pytest tests/unit/test_simulation.py --sim-seed "
                       f"{seed}" for seed, violation, summary in failures[:10])
    assert not failures, f"{len(failures)} of {len(sim_seeds)} seeds broke an invariant:\n{report}"


def test_one_seed_replays_the_same_run():
    first, second = scenario.run(424242, trace=True), scenario.run(424242, trace=True)
    assert first.trace == second.trace and first.summary == second.summary


@pytest.mark.parametrize("name", list(mutations.MUTATIONS))
def test_each_deliberate_bug_is_caught(name):
    """The simulator has teeth: every mutation breaks an invariant on the seeds listed for it."""
    scenario.quiet()
    for seed in mutations.CAUGHT_BY[name]:
        result = scenario.run(seed, mutations.MUTATIONS[name])
        assert not result.ok, f"seed {seed} no longer catches {name!r}: run python -m tests.sim.mutations"
