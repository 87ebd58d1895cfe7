"""The queue in a simulated world: consumers, trackers and their Kafka, seeded runs with faults, the
invariants checked as each run goes (tests/sim/queue_checks.py).

`pytest --sim-seeds 20000` runs more (half as many for the queue as for the harvester); `pytest
--sim-seed 1234` replays one, printing its trace. See docs/simulation.md.
"""

from __future__ import annotations

import pytest

from tests.sim import mutations, queue_scenario, replay
from tests.sim.queue_mutations import QUEUE_MUTATIONS
from tests.support.simulation import PARTS, assert_every_seed_passes, seeds_of_part


@pytest.mark.parametrize("part", range(PARTS))
def test_every_seed_keeps_the_queues_invariants(queue_sim_seeds, part):
    assert_every_seed_passes(queue_scenario.run_quietly, seeds_of_part(queue_sim_seeds, part),
                             "tests/unit/test_queue_simulation.py")


def test_one_seed_replays_the_same_run():
    first, second = queue_scenario.run(424242, trace=True), queue_scenario.run(424242, trace=True)
    assert first.trace == second.trace and first.summary == second.summary


@pytest.mark.parametrize("name", list(QUEUE_MUTATIONS))
def test_each_deliberate_bug_in_the_queue_is_caught(name):
    """The simulator has teeth: every mutation breaks an invariant on the seeds listed for it."""
    replay.quiet()
    assert len(mutations.CAUGHT_BY[name]) >= 1
    for seed in mutations.CAUGHT_BY[name]:
        result = queue_scenario.run(seed, QUEUE_MUTATIONS[name])
        assert not result.ok, f"seed {seed} no longer catches {name!r}: run python -m tests.sim.mutations --queue"
