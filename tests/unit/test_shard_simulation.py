"""Sharded harvesting in the simulated world: replicas of one group sharing N shards through Kafka's group
protocol, each shard's engine the real core and driver, with kills, pauses, joins and rolling restarts.

`pytest --sim-seeds 20000` runs more (a fifth of them here); `pytest --sim-seed 1234` replays one,
printing its trace. See "Shards" in docs/simulation.md.
"""

from __future__ import annotations

import pytest

from tests.sim import mutations, replay, shard_scenario
from tests.support.simulation import PARTS, assert_every_seed_passes, seeds_of_part


@pytest.mark.parametrize("part", range(PARTS))
def test_every_sharded_seed_keeps_the_invariants(shard_sim_seeds, part):
    seeds = sorted(set(shard_sim_seeds) | set(shard_scenario.REGRESSIONS))
    assert_every_seed_passes(shard_scenario.run_quietly, seeds_of_part(seeds, part),
                             "tests/unit/test_shard_simulation.py")


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
