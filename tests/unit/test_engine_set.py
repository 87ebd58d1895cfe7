"""Engine sets (outbox/harvest/supervisor.py's EngineSet): a sharded replica's start, step and end, over a group whose
consumer is a stand-in (no Kafka, no Postgres: _join_group is where those are met), and the end as a step."""

from __future__ import annotations

from typing import Any

from outbox.harvest.config import HarvestConfig
from outbox.harvest.contract import ReplicaState
from outbox.harvest.harvester import HarvestError, State
from outbox.harvest.shards import ShardedHarvester, ShardGroup
from outbox.harvest.supervisor import EngineSet

CONFIG = HarvestConfig(dsn="postgresql://db/shop", shards=2, status_table=None, name="replica-a")


class Consumer:
    """A leader consumer the group assigns nothing to."""

    def __init__(self) -> None:
        self.closed = 0

    def subscribe(self, topics: list[str], **callbacks: Any) -> None:
        pass

    def consume(self, num_messages: int, timeout: float) -> list[Any]:
        return []

    def close(self) -> None:
        self.closed += 1


class Producer:
    def poll(self, timeout: float) -> int:
        return 0

    def flush(self, timeout: float) -> int:
        return 0


class Replica(ShardedHarvester):
    """Joins a group of stand-ins; `stop_while_joining`: a SIGTERM arrives while it joins."""

    def __init__(self, *args: Any, stop_while_joining: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumer = Consumer()
        self.stop_while_joining = stop_while_joining

    def _join_group(self) -> ShardGroup:
        if self.stop_while_joining:
            self.stop()
        return ShardGroup(self.config, self.consumer, Producer())  # type: ignore[arg-type]


def test_a_stop_while_a_sharded_replica_joins_ends_its_start() -> None:
    replica = Replica(CONFIG, stop_while_joining=True)
    replica.start()
    assert replica.wait(0), "stopped at once"
    assert replica.state is State.STOPPED
    assert replica.consumer.closed == 1, "the consumer that never joined is closed"
    assert replica._manager is None and replica._group is None, "no manager, no group thread"


def test_a_sharded_replica_ends_its_own_hubs_and_boards_and_leaves_shared_ones() -> None:
    own = Replica(CONFIG)
    ended: list[str] = []
    own.hubs.close = lambda: ended.append("hubs")  # type: ignore[method-assign]
    own.boards.close = lambda: ended.append("boards")  # type: ignore[method-assign]
    own.start()
    assert own.state is State.RUNNING and own.engines == {} and own.replica_state.value == "standby"
    own.stop()
    assert own.wait(10)
    assert ended == ["hubs", "boards"]
    assert own.consumer.closed == 1, "the group thread left the group"

    host = Replica(CONFIG)  # a process harvesting several outboxes lends its hubs and boards to a sharded one
    shared = Replica(CONFIG, hubs=host.hubs, boards=host.boards)
    host.hubs.close = lambda: ended.append("shared hubs")  # type: ignore[method-assign]
    host.boards.close = lambda: ended.append("shared boards")  # type: ignore[method-assign]
    shared.start()
    shared.stop()
    assert shared.wait(10)
    assert ended == ["hubs", "boards"], "the hubs and boards it was lent are its host's to end"


class Engine:
    """An engine that settles when the test says so; `fails`: its wait() re-raises why it stopped."""

    replica_state = ReplicaState.STANDBY
    published = 0

    def __init__(self, fails: bool = False) -> None:
        self.state = State.RUNNING
        self.fails = fails

    def stop(self) -> None:
        if self.state is State.RUNNING:
            self.state = State.STOPPING

    def wait(self, timeout: float | None = None) -> bool:
        if self.state is not State.STOPPED:
            return False
        if self.fails:
            raise HarvestError("its database went away")
        return True


class Outboxes(EngineSet[str, Engine]):
    """A set of two engines, opened and stepped by the test (no manager thread)."""

    def open(self) -> bool:
        self._state = State.RUNNING
        return True

    def wanted(self, now: float) -> set[str]:
        return {"acme", "globex"}

    def retires(self, key: str, engine: Engine) -> bool:
        return False


def test_the_end_of_an_engine_set_is_a_step_that_ends_it_once_every_engine_settled(caplog) -> None:
    engines = {"acme": Engine(), "globex": Engine(fails=True)}
    ended: list[str] = []
    outboxes = Outboxes(engines.__getitem__, describe=lambda key: f"Outbox {key}'s engine")
    outboxes.hubs.close = lambda: ended.append("hubs")  # type: ignore[method-assign]
    outboxes.boards.close = lambda: ended.append("boards")  # type: ignore[method-assign]
    outboxes.open()
    outboxes.tick()
    assert outboxes.engines == engines

    assert not outboxes.end_step(), "its engines have not settled"
    assert outboxes.state is State.STOPPING and not outboxes.wait(0)
    assert [engine.state for engine in engines.values()] == [State.STOPPING, State.STOPPING], "each asked to stop"
    engines["acme"].state = State.STOPPED
    assert not outboxes.end_step() and outboxes.engines == {"globex": engines["globex"]}
    assert ended == [], "nothing it holds ends while an engine settles"

    engines["globex"].state = State.STOPPED
    assert outboxes.end_step() and outboxes.state is State.STOPPED and outboxes.wait(0)
    assert ended == ["hubs", "boards"]
    assert outboxes.end_step() and ended == ["hubs", "boards"], "ended once"
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == \
        ["Outbox globex's engine: its database went away"], "a failed engine is said once"
