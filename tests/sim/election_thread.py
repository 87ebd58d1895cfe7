"""The election thread on the simulator's clock: the production step (neli.ElectionPoll) over the world's leader
topic, scheduled as runtime.ElectionThread schedules it.

What is modelled here is the world around the step, never the step: a thread that runs it every
min_poll_interval, freezes with its process (SIGSTOP) and ends with it; a thread blocked inside Kafka's revoke
callback until the core answers ReleasePartition (`Held`: the step ends there, and the callback is called
again, returning at once, when it is released: as librdkafka serves a callback it is inside; and at once while
the thread stops, as runtime.ElectionThread's hold returns); the leader topic's consumer, the world's memory
consumer in its group, which hears nothing while the replica's link to the leader topic is down
(`LinkedConsumer`, for the one-table replica of replica.py; a shard's engine polls shards.ShardElection,
production code too); and heartbeats that land a moment after they are sent, if the link holds
(`HeartbeatProducer`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from outbox.harvest.neli import Election, ElectionPoll, Post
from outbox.kafka.memory.broker import MemoryBroker, StoredMessage
from outbox.kafka.memory.consumer import MemoryConsumer
from outbox.kafka.memory.world import SimWorld


class InRevoke(Exception):
    """The election thread entered the revoke callback: it blocks there until released."""


class Held:
    """ElectionPoll's hold on the simulator's clock. The first call announces the revoke and ends the step (the
    thread blocks in the callback); once released, the callback is called again and returns at once."""

    def __init__(self) -> None:
        self.held = False
        self._released = False
        #: The thread is stopping: a revoke callback returns at once, announcing nothing.
        self.stopping = False

    def __call__(self, announce: Callable[[], None]) -> None:
        if self._released or self.stopping:
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
        self.stopped = self.held.stopping = True
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
            if self.world.now < self.process.paused_until:  # SIGSTOP: it runs again at SIGCONT
                self.world.at(self.process.paused_until, self._step)
            return  # else its process ended: no thread is left to run
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


class LinkedConsumer(MemoryConsumer):
    """The leader topic's consumer as librdkafka serves it in a replica's process: the world's memory consumer
    (groups.py's coordinator), except that with the link to the leader topic down a poll reaches nothing: no
    records, no rebalance callbacks (and the coordinator hears nothing from it: `alive`)."""

    def __init__(self, broker: MemoryBroker, config: dict[str, Any], *, name: str, alive: Callable[[], bool],
                 linked: Callable[[], bool]) -> None:
        super().__init__(broker, config, name=name, alive=alive)
        self._linked = linked

    def consume(self, num_messages: int = 1, timeout: float | None = None) -> list[StoredMessage]:
        return super().consume(num_messages, timeout) if self._linked() else []
