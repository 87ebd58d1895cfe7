"""The election thread's step (neli.ElectionPoll over neli.LeaderElection, or a shard's ShardElection), as the
process and the simulator both run it: what a poll tells the core, heartbeats and their age, and a revoke held
in Kafka's callback."""

from __future__ import annotations

from typing import Any

import pytest

from outbox.harvest.neli import ElectionPoll, LeaderElection
from outbox.harvest.shards import ShardElection


class Message:
    def __init__(self, value: bytes, partition: int = 0) -> None:
        self._value, self._partition = value, partition

    def error(self) -> None:
        return None

    def partition(self) -> int:
        return self._partition

    def value(self) -> bytes:
        return self._value


class Consumer:
    """The leader topic: what the next consume() returns, after the callbacks queued for it."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.callbacks: dict[str, Any] = {}
        self.pending: list[str] = []

    def subscribe(self, topics: list[str], on_assign: Any, on_revoke: Any, on_lost: Any) -> None:
        self.callbacks = {"assign": on_assign, "revoke": on_revoke, "lost": on_lost}

    def consume(self, num_messages: int = 1, timeout: float = 0) -> list[Message]:
        while self.pending:
            self.callbacks[self.pending[0]](self, [_Partition0()])
            self.pending.pop(0)
        found, self.messages = self.messages, []
        return found

    def close(self) -> None:
        pass


class _Partition0:
    partition = 0


class Producer:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def produce(self, topic: str, value: bytes, partition: int) -> None:
        self.sent.append(value)

    def poll(self, timeout: float = 0) -> int:
        return 0

    def flush(self, timeout: float = 0) -> int:
        return 0


class Core:
    def __init__(self) -> None:
        self.inputs: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.inputs.append((name, *args))


def election(clock: list[int], max_age: float | None = 1.0) -> tuple[LeaderElection, Consumer, Producer]:
    consumer, producer = Consumer(), Producer()
    return LeaderElection("leader", "r1", consumer, producer, max_age=max_age, clock=lambda: clock[0]), consumer, \
        producer


def test_only_its_own_fresh_heartbeats_count():
    clock = [10**12]
    chosen, consumer, producer = election(clock)
    chosen.start(lambda: None, lambda: None, lambda: None)
    assert chosen.poll(heartbeat=True) is False and len(producer.sent) == 1
    own = producer.sent[0]
    consumer.messages = [Message(own)]
    assert chosen.poll(heartbeat=False) is True, "its heartbeat, back within max_age"
    consumer.messages = [Message(own)]
    clock[0] += int(1.5e9)
    assert chosen.poll(heartbeat=False) is False, "one sent before a pause longer than max_age counts for nothing"
    other, _, other_producer = election(clock)
    other.poll(heartbeat=True)
    consumer.messages = [Message(other_producer.sent[0]), Message(producer.sent[0], partition=1)]
    assert chosen.poll(heartbeat=False) is False, "another incarnation's, or not on partition 0"


def test_a_step_tells_the_core_what_the_poll_saw_and_a_revoke_is_announced_inside_the_hold():
    core, clock = Core(), [10**12]
    chosen, consumer, producer = election(clock)
    holds: list[str] = []

    def hold(announce: Any) -> None:
        holds.append("entered")
        announce()
        holds.append("released")

    step = ElectionPoll(chosen, lambda event: event(core), hold)
    step.start()
    consumer.pending = ["assign"]
    step.heartbeat = True
    step.step()
    assert core.inputs == [("on_assigned",), ("on_polled", False)] and len(producer.sent) == 1
    consumer.messages = [Message(producer.sent[0])]
    consumer.pending = ["revoke"]
    step.step()
    assert holds == ["entered", "released"]
    assert core.inputs[2:] == [("on_revoked",), ("on_polled", True)], "the revoke in the hold, then the poll"


def test_a_shard_event_whose_callback_raised_is_the_next_polls():
    """A thread blocked in the revoke callback (the simulator's step ends there) takes it again on the next
    poll, and the events after it."""

    class Group:
        def attach(self, election: ShardElection) -> None: ...
        def detach(self, election: ShardElection) -> None: ...
        def heartbeat(self, shard: int, signature: bytes) -> None: ...

    served: list[str] = []
    blocked = [True]

    def revoked() -> None:
        served.append("revoke")
        if blocked[0]:
            raise RuntimeError("blocked")

    shard = ShardElection(Group(), 0, "r1-s0")  # type: ignore[arg-type]
    shard.start(lambda: served.append("assign"), revoked, lambda: served.append("lost"))
    for event in ("assign", "revoke", "lost"):
        shard.notify(event)
    shard.heard()
    with pytest.raises(RuntimeError):
        shard.poll(heartbeat=False)
    assert served == ["assign", "revoke"] and not shard.gone
    blocked[0] = False
    assert shard.poll(heartbeat=False) is False, "gone once the revoke returned"
    assert served == ["assign", "revoke", "revoke"] and shard.gone, "the lost after it is not served: gone"
