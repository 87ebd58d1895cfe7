"""The core in a simulated world: thousands of seeded runs, faults included, then the invariants.

`pytest --sim-seeds 20000` runs more; `pytest --sim-seed 1234` replays one, printing its trace.
See docs/simulation.md for what is simulated and what each check means.
"""

from __future__ import annotations

import pytest

from tests.sim import mutations, replay, scenario
from tests.support.simulation import assert_every_seed_passes


def test_every_seed_keeps_the_invariants(sim_seeds):
    assert_every_seed_passes(scenario.run_quietly, sim_seeds, "tests/unit/test_simulation.py")


def test_one_seed_replays_the_same_run():
    first, second = scenario.run(424242, trace=True), scenario.run(424242, trace=True)
    assert first.trace == second.trace and first.summary == second.summary


@pytest.mark.parametrize("name", list(mutations.MUTATIONS))
def test_each_deliberate_bug_is_caught(name):
    """The simulator has teeth: every mutation breaks an invariant on the seeds listed for it."""
    replay.quiet()
    for seed in mutations.CAUGHT_BY[name]:
        result = scenario.run(seed, mutations.MUTATIONS[name])
        assert not result.ok, f"seed {seed} no longer catches {name!r}: run python -m tests.sim.mutations"
