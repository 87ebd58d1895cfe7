"""A sharded replica as an engine set (outbox/harvest/supervisor.py's EngineSet): its start, its step and its end,
over a group whose consumer is a stand-in (no Kafka, no Postgres: _join_group is where those are met)."""

from __future__ import annotations

from typing import Any

from outbox.harvest.config import HarvestConfig
from outbox.harvest.harvester import State
from outbox.harvest.shards import ShardedHarvester, ShardGroup

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
