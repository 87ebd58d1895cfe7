"""Processes harvesting many outboxes in the simulated world: the production ManyHarvester stepped on the world's
clock, an engine per outbox (the real core and driver), with outboxes created and dropped while running, engine
threads failing, discovery failing for a while, and processes killed or paused.

`pytest --sim-seeds 20000` runs more (a twentieth of them here); `pytest --sim-seed 1234` replays one, printing its
trace. See "Many outboxes" in docs/simulation.md.
"""

from __future__ import annotations

import pytest

from tests.sim import many_scenario, mutations, replay
from tests.support.simulation import assert_every_seed_passes


def test_every_many_outboxes_seed_keeps_the_invariants(many_sim_seeds):
    assert_every_seed_passes(many_scenario.run_quietly, many_sim_seeds, "tests/unit/test_many_simulation.py")


def test_one_many_outboxes_seed_replays_the_same_run():
    first, second = many_scenario.run(4242, trace=True), many_scenario.run(4242, trace=True)
    assert first.trace == second.trace and first.summary == second.summary


@pytest.mark.parametrize("name", list(mutations.MANY_MUTATIONS))
def test_each_deliberate_many_outboxes_bug_is_caught(name):
    """The runs have teeth: every mutation of the process breaks an invariant on the seeds listed for it."""
    replay.quiet()
    for seed in mutations.CAUGHT_BY[name]:
        result = many_scenario.run(seed, mutations.MANY_MUTATIONS[name])
        assert not result.ok, f"seed {seed} no longer catches {name!r}: run python -m tests.sim.mutations --many"
