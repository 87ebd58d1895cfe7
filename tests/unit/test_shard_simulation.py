"""Sharded harvesting in the simulated world: replicas of one group sharing N shards through Kafka's group
protocol, each shard's engine the real core and driver, with kills, pauses, joins and rolling restarts.

`pytest --sim-seeds 20000` runs more (a fifth of them here); `pytest --sim-seed 1234` replays one,
printing its trace. See "Shards" in docs/simulation.md.
"""

from __future__ import annotations

import pytest

from tests.sim import mutations, replay, shard_scenario
from tests.support.simulation import assert_every_seed_passes


def test_every_sharded_seed_keeps_the_invariants(shard_sim_seeds):
    seeds = [seed for seed in shard_sim_seeds if seed not in shard_scenario.KNOWN_FAILURES]
    assert_every_seed_passes(shard_scenario.run_quietly, seeds, "tests/unit/test_shard_simulation.py")


@pytest.mark.parametrize("seed", list(shard_scenario.KNOWN_FAILURES))
def test_known_failures_still_fail(seed):
    """The seeds of what the simulator found and is not fixed yet (shard_scenario.KNOWN_FAILURES): when one
    passes, the fix worked, and it belongs with the seeds that must pass."""
    replay.quiet()
    result = shard_scenario.run(seed)
    assert not result.ok, f"seed {seed} passes now: remove it from shard_scenario.KNOWN_FAILURES"


def test_one_sharded_seed_replays_the_same_run():
    first, second = shard_scenario.run(4242, trace=True), shard_scenario.run(4242, trace=True)
    assert first.trace == second.trace and first.summary == second.summary


@pytest.mark.parametrize("name", list(mutations.SHARD_MUTATIONS))
def test_each_deliberate_shard_bug_is_caught(name):
    """The sharded runs have teeth: every shard mutation breaks an invariant on the seeds listed for it."""
    replay.quiet()
    for seed in mutations.CAUGHT_BY[name]:
        result = shard_scenario.run(seed, mutations.SHARD_MUTATIONS[name])
        assert not result.ok, f"seed {seed} no longer catches {name!r}: run python -m tests.sim.mutations --shards"
