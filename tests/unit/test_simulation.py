"""The core in a simulated world: thousands of seeded runs, faults included, then the invariants.

`pytest --sim-seeds 20000` runs more; `pytest --sim-seed 1234` replays one, printing its trace.
See docs/simulation.md for what is simulated and what each check means.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from outbox.harvest.core import Core
from tests.sim import mutations, replay, scenario
from tests.support.simulation import PARTS, assert_every_seed_passes, seeds_of_part


@pytest.mark.parametrize("part", range(PARTS))
def test_every_seed_keeps_the_invariants(sim_seeds, part):
    assert_every_seed_passes(scenario.run_quietly, seeds_of_part(sim_seeds, part), "tests/unit/test_simulation.py")


def test_one_seed_replays_the_same_run():
    first, second = scenario.run(424242, trace=True), scenario.run(424242, trace=True)
    assert first.trace == second.trace and first.summary == second.summary


class FailsItsOwnCheckOnce(Core):
    """A core whose own bookkeeping check (Core.check_invariants) fails once, on its 200th turn, and never again."""

    turns = 0

    def check_invariants(self) -> None:
        super().check_invariants()
        FailsItsOwnCheckOnce.turns += 1
        assert FailsItsOwnCheckOnce.turns != 200, "planted: the core's books out of step once"


def test_a_core_that_fails_its_own_check_is_a_broken_invariant_not_an_engine_failure():
    """The Harvester ends its engine on any failure, an AssertionError from the core's own checks included, and the
    replica starts again: a run would recover and pass. The simulator takes such a failure inside the step for what it
    is, a broken invariant, and fails the seed with it."""
    replay.quiet()
    FailsItsOwnCheckOnce.turns = 0
    result = scenario.run(1, scenario.Options(core_factory=FailsItsOwnCheckOnce))
    assert not result.ok and "planted: the core's books out of step once" in (result.violation or "")
    assert FailsItsOwnCheckOnce.turns == 200, "it stopped at the failed check"


@pytest.mark.parametrize("name", list(mutations.MUTATIONS))
def test_each_deliberate_bug_is_caught(name):
    """The simulator has teeth: every mutation breaks an invariant on the seeds listed for it."""
    replay.quiet()
    for seed in mutations.CAUGHT_BY[name]:
        result = scenario.run(seed, mutations.MUTATIONS[name])
        assert not result.ok, f"seed {seed} no longer catches {name!r}: run python -m tests.sim.mutations"


def test_the_database_fence_alone_stops_a_leader_that_does_not_fence_itself():
    """A leader that goes on when it no longer sees its heartbeats is stopped by the database fence: its
    next mark fails, or its next purge that reads the fence finds it gone (Settling.purge_reads_fence).
    The seeds where that same leader breaks order without the fence included (CAUGHT_BY of "no
    fencing on missing heartbeats"), and those where purges that do not read it do."""
    replay.quiet()
    options = scenario.Options(core_factory=mutations.with_part(leadership=mutations.NoHeartbeatFence), per_key=1,
                               db_fence=True)
    seeds = {*mutations.CAUGHT_BY["no fencing on missing heartbeats"],
             *mutations.CAUGHT_BY["purges and resets never read the fence, no heartbeat fence"],
             *mutations.CAUGHT_BY["a purge something waits on not reading the fence after a mark, no heartbeat fence"],
             *range(1, 101)}
    failed = {seed: result.violation for seed in sorted(seeds) if not (result := scenario.run(seed, options)).ok}
    assert not failed, failed


def test_records_that_kafka_takes_for_duplicates_are_sent_again():
    """Producers that now and then number a partition's records from 0 again: Kafka acknowledges those
    as duplicates of what it wrote first and writes nothing (outbox/harvest/acks.py). With one record
    per key in flight, nothing is lost and order holds; the seeds include those that catch a driver
    that takes such acknowledgements for delivery (CAUGHT_BY)."""
    replay.quiet()
    options = scenario.Options(per_key=1, lost_sequences=True)
    seeds = {*mutations.CAUGHT_BY["an acknowledgement at an offset already written taken for delivery"],
             *range(1, 61)}
    failed = {seed: result.violation for seed in sorted(seeds) if not (result := scenario.run(seed, options)).ok}
    assert not failed, failed


@pytest.mark.parametrize("per_key", [1, 4])
def test_database_restarts_undo_asynchronous_purges_without_breaking_order(per_key):
    """The database server crashes and restarts now and then (MemoryTable.restart): the purges that
    committed asynchronously and were not flushed come back. With several records per key in flight
    purges are asynchronous (Settling.purges_durable), and the records they bring back are published again,
    as repeats; with one per key they are durable. The seeds include those that catch asynchronous
    purges with one record per key (CAUGHT_BY)."""
    replay.quiet()
    options = scenario.Options(per_key=per_key, db_restarts=True)
    seeds = {*mutations.CAUGHT_BY["purges committed asynchronously with one record per key in flight"],
             *range(1, 61)}
    results = [scenario.run(seed, options, trace=True) for seed in sorted(seeds)]
    failed = {result.seed: result.violation for result in results if not result.ok}
    assert not failed, failed
    undone = [result.seed for result in results
              if any("purges undone: [" in line and "undone: []" not in line for line in result.trace)]
    assert bool(undone) == (per_key > 1), f"runs where a restart undid purges: {undone}"


@pytest.mark.parametrize("module", ["scenario", "shard_scenario", "queue_scenario", "many_scenario"])
def test_docs_simulation_replay_command_runs_a_seed(module):
    """docs/simulation.md's `python -m tests.sim.<scenario> SEED`, outside pytest."""
    done = subprocess.run([sys.executable, "-m", f"tests.sim.{module}", "1"], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and done.stdout.startswith("ok   seed 1:"), done.stdout + done.stderr[-2000:]
