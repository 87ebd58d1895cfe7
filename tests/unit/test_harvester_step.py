"""The Harvester's engine thread as a step (Harvester.open, Harvester.step): what the real thread runs in a loop and
the simulator runs on its clock. One replica of one table in a seeded world (tests/sim/engine.py), stepped to each
moment of its life; no thread, no wall-clock wait."""

from __future__ import annotations

import pytest

from outbox.harvest.contract import ReplicaState
from outbox.harvest.harvester import HarvestError, State
from outbox.harvest.memory_table import MemoryTable
from outbox.kafka.memory.broker import MemoryBroker
from outbox.kafka.memory.world import SimWorld
from tests.sim.replica import Log, SimReplica
from tests.sim.scenario import limits_for


@pytest.fixture
def world():
    return SimWorld(1)


@pytest.fixture
def replica(world):
    kafka = MemoryBroker(world, partitions=1)
    table = MemoryTable(world, published=kafka.published.__contains__)
    replica = SimReplica(world, "r0", "g1", limits_for(world, 1), kafka, table, Log())
    for key in ("a", "b", "a"):
        table.commit(table.insert(key, "v"))
    return replica


def run_until(world, condition, *, within: float = 30.0) -> None:
    end = world.now + within
    world.run_until(end, done=condition)
    assert condition(), f"not within {within}s of the world's clock"


def test_a_started_harvester_leads_and_publishes_by_its_steps(world, replica):
    harvester = replica.harvester
    assert harvester.state is State.CREATED
    replica.start()  # open() and the first step due at once: no engine thread
    assert harvester.state is State.RUNNING and harvester.wait(0) is False
    run_until(world, lambda: harvester.published == 3)
    assert harvester.replica_state is ReplicaState.LEADER and harvester.is_leader
    assert [message.key() for message in replica.kafka.messages("orders")] == [b"a", b"b", b"a"]


def test_stop_settles_then_ends_and_closes_what_it_opened(world, replica):
    harvester = replica.harvester
    replica.start()
    run_until(world, lambda: harvester.is_leader)
    harvester.stop()
    assert harvester.state is State.STOPPING
    run_until(world, lambda: harvester.state is State.STOPPED)
    assert harvester.wait(0) is True  # no failure to re-raise
    assert replica.engine.ended and not replica.store.fence.alive
    assert replica.running is False  # the process exits once its harvester ended


def test_a_thread_of_its_io_that_dies_ends_the_engine_at_its_next_step(world, replica):
    harvester = replica.harvester
    replica.start()
    run_until(world, lambda: harvester.is_leader)
    replica.engine.fail("the delivery thread died")
    assert harvester.state is State.RUNNING  # the engine thread has not looked yet
    run_until(world, lambda: harvester.state is State.STOPPED, within=0.0)
    with pytest.raises(HarvestError, match="harvester failed: the delivery thread died"):
        harvester.wait(0)
    assert not replica.store.fence.alive  # the fence went with its session: another replica may take over
    published = harvester.published
    world.run_until(world.now + 5.0)
    assert harvester.published == published  # nothing runs once it ended
