"""A share queue in the simulated world: consumers running the real ShareQueueConsumer and share_state.py over a
memory model of Kafka's share groups, with crashes, pauses past the lock and the session, graceful stops, poison
messages, Retry(delay) and handlers slower than the lock (tests/sim/share_checks.py's invariants).

`pytest --sim-seeds 20000` runs more (a fifth of them here); `pytest --sim-seed 1234` replays one, printing its
trace. See "The share backend in the simulator" in docs/simulation.md.
"""

from __future__ import annotations

import pytest

from tests.sim import mutations, replay, share_scenario
from tests.support.simulation import assert_every_seed_passes


def test_every_seed_keeps_the_share_queues_invariants(share_sim_seeds):
    seeds = sorted(set(share_sim_seeds) | set(share_scenario.REGRESSIONS))
    assert_every_seed_passes(share_scenario.run_quietly, seeds, "tests/unit/test_share_simulation.py")


def test_one_share_seed_replays_the_same_run():
    first, second = share_scenario.run(4242, trace=True), share_scenario.run(4242, trace=True)
    assert first.trace == second.trace and first.summary == second.summary


@pytest.mark.parametrize("name", list(mutations.SHARE_MUTATIONS))
def test_each_deliberate_bug_in_the_share_backend_is_caught(name):
    """The share runs have teeth: every mutation breaks an invariant on the seeds listed for it."""
    replay.quiet()
    assert len(mutations.CAUGHT_BY[name]) >= 1
    for seed in mutations.CAUGHT_BY[name]:
        result = share_scenario.run(seed, mutations.SHARE_MUTATIONS[name])
        assert not result.ok, f"seed {seed} no longer catches {name!r}: run python -m tests.sim.mutations --share"
