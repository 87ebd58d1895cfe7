"""The queue in a simulated world: consumers, trackers and their Kafka, seeded runs with faults, the
invariants checked as each run goes (tests/sim/queue_checks.py).

`pytest --sim-seeds 20000` runs more (half as many for the queue as for the harvester); `pytest
--sim-seed 1234` replays one, printing its trace. See docs/simulation.md.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.sim import mutations, queue_scenario
from tests.sim.queue_mutations import QUEUE_MUTATIONS


def test_every_seed_keeps_the_queues_invariants(queue_sim_seeds):
    workers = min(len(queue_sim_seeds), os.cpu_count() or 1)
    # Fresh processes ("spawn"): forking a test process that has threads running is not safe.
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(queue_scenario.run_quietly, queue_sim_seeds,
                                chunksize=max(1, len(queue_sim_seeds) // (workers * 8))))
    failures = [(seed, violation, summary) for seed, violation, summary in results if violation]
    report = "\n".join(f"{summary}\n    {violation}\n    replay: pytest tests/unit/test_queue_simulation.py "
                       f"--sim-seed {seed}" for seed, violation, summary in failures[:10])
    assert not failures, f"{len(failures)} of {len(queue_sim_seeds)} seeds broke an invariant:\n{report}"


def test_one_seed_replays_the_same_run():
    first, second = queue_scenario.run(424242, trace=True), queue_scenario.run(424242, trace=True)
    assert first.trace == second.trace and first.summary == second.summary


@pytest.mark.parametrize("name", list(QUEUE_MUTATIONS))
def test_each_deliberate_bug_in_the_queue_is_caught(name):
    """The simulator has teeth: every mutation breaks an invariant on the seeds listed for it."""
    queue_scenario.quiet()
    assert len(mutations.CAUGHT_BY[name]) >= 1
    for seed in mutations.CAUGHT_BY[name]:
        result = queue_scenario.run(seed, QUEUE_MUTATIONS[name])
        assert not result.ok, f"seed {seed} no longer catches {name!r}: run python -m tests.sim.mutations --queue"
