"""The election thread on the simulator's clock: the production step (neli.ElectionPoll) over the world's leader
topic, scheduled as runtime.ElectionThread schedules it.

What is modelled here is the world around the step, never the step: a thread that runs it every
min_poll_interval, freezes with its process (SIGSTOP) and ends with it; a thread blocked inside Kafka's revoke
callback until the core answers ReleasePartition (`Held`: the step ends there, and the callback is called
again, returning at once, when it is released: as librdkafka serves a callback it is inside); the leader
topic's consumer as librdkafka serves it over the world's group (`LeaderTopicConsumer`, for the one-table
replica of replica.py; a shard's engine polls shards.ShardElection, production code too); and heartbeats that
land a moment after they are sent, if the link holds (`HeartbeatProducer`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from confluent_kafka import TopicPartition

from outbox.harvest.neli import Election, ElectionPoll, Post
from outbox.kafka.memory.broker import Group, Member, MemoryBroker, StoredMessage
from outbox.kafka.memory.world import SimWorld


class InRevoke(Exception):
    """The election thread entered the revoke callback: it blocks there until released."""


class Held:
    """ElectionPoll's hold on the simulator's clock. The first call announces the revoke and ends the step (the
    thread blocks in the callback); once released, the callback is called again and returns at once."""

    def __init__(self) -> None:
        self.held = False
        self._released = False

    def __call__(self, announce: Callable[[], None]) -> None:
        if self._released:
            self._released = False
            return
        announce()
        self.held = True
        raise InRevoke

    def release(self) -> bool:
        """ReleasePartition (or the thread stops): True if a step was held in the callback."""
        if not self.held:
            return False
        self.held, self._released = False, True
        return True


class Process(Protocol):
    world: SimWorld
    crashed: bool
    paused_until: float

    def process_running(self) -> bool: ...


class SimElectionThread:
    """runtime.ElectionThread on the world's clock: the production ElectionPoll's step every `interval`, from
    start() until stop(); held in a revoke until released(), then the step is carried on at once."""

    def __init__(self, process: Process, election: Election, post: Post, interval: float,
                 poll_class: type[ElectionPoll] = ElectionPoll) -> None:
        self.process = process
        self.world = process.world
        self.interval = interval
        self.held = Held()
        self.poll = poll_class(election, post, self.held)
        self.stopped = False

    def start(self) -> None:
        self.poll.start()
        self.world.after(0.0, self._step)

    def released(self) -> None:
        """ReleasePartition: the revoke callback returns, and the poll it was in goes on."""
        if self.held.release():
            self._run_step()

    def stop(self) -> None:
        """The thread stops (ElectionThread.stop): a revoke callback under way returns at once, the poll it was in
        ends, and the election closes (the consumer leaves the group)."""
        if self.stopped:
            return
        self.stopped = True
        if self.held.release():
            try:
                self.poll.step()
            except InRevoke:  # a second revoke in the same poll: the thread ends in it
                pass
        self.poll.close()

    def _step(self) -> None:
        if self.stopped or self.held.held or self.process.crashed:
            return
        if not self.process.process_running():
            self.world.at(self.process.paused_until, self._step)
            return
        self._run_step()

    def _run_step(self) -> None:
        try:
            self.poll.step()
        except InRevoke:
            return
        self.world.after(self.interval, self._step)


class Replica(Protocol):
    world: SimWorld
    name: str
    kafka: MemoryBroker
    links: Any
    crashed: bool
    stopped: bool


class HeartbeatProducer:
    """A replica's heartbeat producer: a heartbeat lands a moment later, if the link holds."""

    def __init__(self, replica: Replica) -> None:
        self._replica = replica

    def produce(self, topic: str, value: bytes | None = None, partition: int = -1, **_: Any) -> None:
        replica = self._replica

        def lands() -> None:
            if replica.links.leader and not replica.crashed:
                replica.kafka.append(topic, partition, None, value, None, replica=replica.name)
        if replica.links.leader:
            replica.world.after(replica.world.latency(0.001, 0.01), lands)

    def poll(self, timeout: float = 0) -> int:
        return 0

    def flush(self, timeout: float = 0) -> int:
        return 0


Callback = Callable[[Any, list[TopicPartition]], None]


class LeaderTopicConsumer:
    """The leader topic's consumer as librdkafka serves it, over the world's group (broker.Group: who owns
    partition 0). The rebalance callbacks run inside consume(), in order; one the thread is blocked in (it
    raised InRevoke) is called again at the next consume, and Kafka moves partition 0 on only once it returned.
    Partition 0's new messages are returned while the member owns it; with the link to the leader topic down,
    consume() returns nothing and the coordinator does not hear from it. After a loss, librdkafka rejoins by
    itself (unless the process is stopping)."""

    def __init__(self, replica: Replica, group: Group, member: Member, topic: str) -> None:
        self._replica, self._group, self._member, self._topic = replica, group, member, topic
        self._callbacks: dict[str, Callback] = {}
        self._offset = 0

    def subscribe(self, topics: list[str], on_assign: Callback, on_revoke: Callback, on_lost: Callback) -> None:
        self._callbacks = {"assign": on_assign, "revoke": on_revoke, "lost": on_lost}
        self._group.join(self._member)

    def consume(self, num_messages: int = 1, timeout: float | None = None) -> list[StoredMessage]:
        if not self._replica.links.leader:
            return []
        member, group = self._member, self._group
        while member.events:
            event = member.events[0]
            self._callbacks[event](self, [TopicPartition(self._topic, 0)])
            member.events.popleft()
            if event == "revoke":
                group.revoked(member)
            elif event == "lost" and not self._replica.stopped:
                group.join(member)
        heartbeats = self._replica.kafka.log(self._topic, 1)[0]
        if group.owner is not member:
            self._offset = len(heartbeats)  # not assigned: it fetches nothing, and starts at the end when it is
            return []
        fresh = heartbeats[self._offset:self._offset + num_messages]
        self._offset += len(fresh)
        return fresh

    def close(self) -> None:
        self._group.leave(self._member)
