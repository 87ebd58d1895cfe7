"""Simulated Kafka: partition logs, the leader-election group, and idempotent producers.

What the harvester relies on, and what goes wrong with it, is modelled; the wire is not:
- a producer writes each partition in sequence: the broker appends a batch only if it is the next
  one expected from that producer session (so a partition's log holds a prefix of what was sent),
  refuses a whole batch that holds a poison record, may lose a batch's acknowledgement (the batch
  is written; librdkafka retries it and the broker answers "duplicate"), or fails it for a while;
- with `gapless` (several records of a key in flight) a refused batch is a fatal error: nothing
  after it is written, and every record in the producer fails; without it (one in flight per key),
  librdkafka's own delivery timeout fails records, queued ones unwritten, in-flight ones perhaps written;
- purging a producer fails everything in it at once; batches already on the wire land or not,
  decided at that moment (a modelling simplification);
- the group coordinator gives partition 0 of the leader topic to one live member; a member it has
  not heard from for the session timeout is dropped and the partition moves (the dropped member
  learns it is lost only when it can poll again); a member leaving gracefully is revoked first.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from outbox.harvest.commands import DeliveryError
from outbox.harvest.contract import Record
from tests.sim.table import POISON
from tests.sim.world import World


@dataclass(slots=True)
class Written:
    record_id: int
    key: str
    producer: int
    replica: str
    time: float


@dataclass
class ProducerFaults:
    transient: float = 0.0  # a batch is not written this time (retried)
    ack_lost: float = 0.0  # a batch is written but its acknowledgement lost (retried: duplicate)
    fatal: float = 0.0  # the producer fails fatally at a batch
    latency: tuple[float, float] = (0.0005, 0.004)


@dataclass(eq=False)
class Message:
    record: Record
    partition: int
    enqueued: float
    on_report: Callable[[int, DeliveryError | None], None]
    seq: int = -1
    state: str = "queued"  # queued, inflight, done


@dataclass(eq=False)
class Batch:
    messages: list[Message]
    partition: int
    first_seq: int
    epoch: int


PERMANENT = DeliveryError("MSG_SIZE_TOO_LARGE", "Broker: Message size too large", permanent=True)
TIMED_OUT = DeliveryError("_MSG_TIMED_OUT", "Local: Message timed out")
PURGED = DeliveryError("_PURGE_QUEUE", "Local: Purged in queue")
FATAL = DeliveryError("_FATAL", "Local: Fatal error", fatal=True)


class SimKafka:
    def __init__(self, world: World, *, partitions: int = 3, faults: ProducerFaults | None = None) -> None:
        self.world = world
        self.partitions = partitions
        self.faults = faults or ProducerFaults()
        self.logs: list[list[Written]] = [[] for _ in range(partitions)]
        self.published: set[int] = set()
        self._producer_ids = 0
        #: (producer id, epoch, partition) -> next expected sequence
        self._expected: dict[tuple[int, int, int], int] = {}
        self._fenced_epochs: dict[int, int] = {}
        self.groups: dict[str, Group] = {}
        self.down_until = 0.0  # the whole cluster unreachable

    def partition_of(self, key: str) -> int:
        return zlib.crc32(key.encode()) % self.partitions

    def new_producer_id(self) -> int:
        self._producer_ids += 1
        return self._producer_ids

    def group(self, name: str, session_timeout: float) -> Group:
        if name not in self.groups:
            self.groups[name] = Group(self.world, name, session_timeout)
        return self.groups[name]

    def accept(self, producer: SimProducer, batch: Batch) -> str:
        """The broker's decision for a batch: 'written', 'duplicate', 'out_of_order', 'refused', 'fenced'."""
        if batch.epoch < self._fenced_epochs.get(producer.id, 0):
            return "fenced"
        if any(m.record.value == POISON for m in batch.messages):
            return "refused"
        key = (producer.id, batch.epoch, batch.partition)
        expected = self._expected.get(key, 0)
        if batch.first_seq > expected:
            return "out_of_order"
        if batch.first_seq < expected:
            return "duplicate"
        self._expected[key] = expected + len(batch.messages)
        self._fenced_epochs[producer.id] = batch.epoch
        log = self.logs[batch.partition]
        for message in batch.messages:
            record = message.record
            log.append(Written(record.id, record.key, producer.id, producer.replica, self.world.now))
            self.published.add(record.id)
        return "written"


class SimProducer:
    """One librdkafka producer instance (one idempotent producer id)."""

    def __init__(self, kafka: SimKafka, replica: str, *, gapless: bool, delivery_timeout: float | None,
                 is_running: Callable[[], bool], can_reach: Callable[[], bool]) -> None:
        self.kafka = kafka
        self.world = kafka.world
        self.id = kafka.new_producer_id()
        self.replica = replica
        self.gapless = gapless
        self.delivery_timeout = delivery_timeout  # None: librdkafka never times out on its own
        self._is_running = is_running
        self._can_reach = can_reach
        self.epoch = 0
        self.queues: dict[int, deque[Message]] = {}
        self.inflight: dict[int, deque[Batch]] = {}
        self._next_seq: dict[int, int] = {}
        self.failed_fatally = False
        self.closed = False
        self._pumping = False

    def outstanding(self) -> int:
        return sum(len(q) for q in self.queues.values()) + sum(
            len(b.messages) for batches in self.inflight.values() for b in batches)

    def produce(self, record: Record, on_report: Callable[[int, DeliveryError | None], None]) -> None:
        if self.failed_fatally:
            self.world.after(0, lambda: on_report(record.id, FATAL))
            return
        partition = self.kafka.partition_of(record.key)
        self.queues.setdefault(partition, deque()).append(Message(record, partition, self.world.now, on_report))
        self._schedule_pump(0.0)

    def _schedule_pump(self, delay: float) -> None:
        if not self._pumping and not self.closed:
            self._pumping = True
            self.world.after(delay, self._pump)

    def _pump(self) -> None:
        """librdkafka's broker threads: time out, then transmit what can go (a process paused sends nothing)."""
        self._pumping = False
        if self.closed:
            return
        if not self._is_running():
            self._schedule_pump(0.05)
            return
        self._expire()
        busy = False
        for partition, queue in self.queues.items():
            if not queue:
                continue
            busy = True
            inflight = self.inflight.setdefault(partition, deque())
            if len(inflight) >= 5 or not self._can_reach():
                continue
            count = min(len(queue), self.world.rng.randint(1, 8))
            messages = [queue.popleft() for _ in range(count)]
            seq = self._next_seq.get(partition, 0)
            for i, message in enumerate(messages):
                if message.seq < 0:
                    message.seq = seq + i
            first = messages[0].seq
            self._next_seq[partition] = max(self._next_seq.get(partition, 0), messages[-1].seq + 1)
            for message in messages:
                message.state = "inflight"
            batch = Batch(messages, partition, first, self.epoch)
            inflight.append(batch)
            self.world.after(self.world.latency(*self.kafka.faults.latency), lambda b=batch: self._arrive(b))
        if busy:
            self._schedule_pump(0.002)

    def _arrive(self, batch: Batch) -> None:
        """The batch reaches the partition leader."""
        if self.closed or batch not in self.inflight.get(batch.partition, ()):
            return
        if not self._can_reach():
            self._retry(batch, 0.05)
            return
        faults = self.kafka.faults
        if self.world.chance(faults.transient):
            self._retry(batch, 0.01)
            return
        if self.world.chance(faults.fatal):
            self._fatal(batch, FATAL)
            return
        verdict = self.kafka.accept(self, batch)
        if verdict in {"out_of_order"}:
            self._retry(batch, 0.005)
            return
        if verdict == "refused":
            if self.gapless:
                self._fatal(batch, PERMANENT)
            else:
                self._finish(batch, PERMANENT)
                self._bump_epoch(batch.partition)
            return
        if verdict == "fenced":
            self._finish(batch, DeliveryError("_FENCED", "Broker: producer fenced", fatal=True))
            return
        if verdict == "written" and self.world.chance(faults.ack_lost):
            self._retry(batch, 0.05)  # written; the retry will come back "duplicate"
            return
        self.world.after(self.world.latency(*faults.latency), lambda: self._finish(batch, None))

    def _retry(self, batch: Batch, delay: float) -> None:
        self.world.after(delay, lambda: self._arrive(batch))

    def _finish(self, batch: Batch, error: DeliveryError | None) -> None:
        inflight = self.inflight.get(batch.partition)
        if inflight is None or batch not in inflight:
            return
        inflight.remove(batch)
        for message in batch.messages:
            self._report(message, error)
        self._schedule_pump(0.0)

    def _report(self, message: Message, error: DeliveryError | None) -> None:
        if message.state == "done":
            return
        message.state = "done"
        record_id = message.record.id
        on_report = message.on_report
        # Delivery reports reach the application through poll(): later, never at once.
        self.world.after(self.world.latency(0.0002, 0.002), lambda: on_report(record_id, error))

    def _bump_epoch(self, partition: int) -> None:
        """After a failure librdkafka drains the partition and restarts its sequence (a gap is possible)."""
        self.epoch += 1
        for queue in self.queues.values():
            for message in queue:
                message.seq = -1
        self._next_seq = {}

    def _expire(self) -> None:
        """librdkafka's own message timeout (only with one record per key in flight)."""
        if self.delivery_timeout is None:
            return
        deadline = self.world.now - self.delivery_timeout
        expired_any = False
        for partition, queue in self.queues.items():
            while queue and queue[0].enqueued < deadline:
                self._report(queue.popleft(), TIMED_OUT)
                expired_any = True
            inflight = self.inflight.get(partition, deque())
            for batch in list(inflight):
                if batch.messages[0].enqueued < deadline:
                    inflight.remove(batch)
                    self._resolve_now(batch)
                    for message in batch.messages:
                        self._report(message, TIMED_OUT)
                    expired_any = True
            if expired_any:
                self._bump_epoch(partition)

    def _resolve_now(self, batch: Batch) -> None:
        """A batch on the wire when it was given up: it lands or not, decided now."""
        if self._can_reach() and self.world.chance(0.5):
            self.kafka.accept(self, batch)

    def _fatal(self, at: Batch, error: DeliveryError) -> None:
        self.failed_fatally = True
        inflight = self.inflight.get(at.partition)
        if inflight is not None and at in inflight:
            inflight.remove(at)
            for message in at.messages:
                self._report(message, error)
        self.purge(FATAL)

    def purge(self, error: DeliveryError = PURGED) -> None:
        """Fail everything: queued records unwritten; batches on the wire land or not, now."""
        for queue in self.queues.values():
            while queue:
                self._report(queue.popleft(), error)
        for inflight in self.inflight.values():
            while inflight:
                batch = inflight.popleft()
                self._resolve_now(batch)
                for message in batch.messages:
                    self._report(message, error)
        self.epoch += 1
        self._next_seq = {}

    def close(self) -> None:
        self.closed = True


@dataclass(eq=False)
class Member:
    replica: str
    alive: Callable[[], bool]  # heard by the coordinator (running and reachable)
    events: deque[str] = field(default_factory=deque)  # assign / lost, served at its next poll
    last_heard: float = 0.0
    left: bool = False


class Group:
    """The leader topic's consumer group: who owns partition 0."""

    def __init__(self, world: World, name: str, session_timeout: float) -> None:
        self.world = world
        self.name = name
        self.session_timeout = session_timeout
        self.members: list[Member] = []
        self.owner: Member | None = None
        self.heartbeats: list[tuple[str, float]] = []  # partition 0 of the leader topic: (signature, time)
        self._watching = False
        self._rebalancing = False

    def join(self, member: Member) -> None:
        member.last_heard = self.world.now
        self.members.append(member)
        self._watch()
        self._rebalance_soon()

    def leave(self, member: Member) -> None:
        """A graceful leave (the member has run its revoke callback): hand the partition on at once."""
        member.left = True
        if member in self.members:
            self.members.remove(member)
        if self.owner is member:
            self.owner = None
            self._rebalance_soon()

    def _watch(self) -> None:
        if not self._watching:
            self._watching = True
            self.world.after(0.1, self._tick)

    def _tick(self) -> None:
        now = self.world.now
        for member in list(self.members):
            if member.alive():
                member.last_heard = now
            elif now - member.last_heard > self.session_timeout and not member.left:
                # The session expired: the member is out; it learns so when it can poll again.
                self.members.remove(member)
                member.events.clear()
                member.events.append("lost")
                if self.owner is member:
                    self.owner = None
                self._rebalance_soon()
        if self.owner is None and not self._rebalancing and any(m.alive() for m in self.members):
            self._rebalance_soon()  # a member came back: the coordinator hears from it and rebalances
        self.world.after(0.1, self._tick)

    def _rebalance_soon(self) -> None:
        self._rebalancing = True
        self.world.after(self.world.latency(0.05, 0.5), self._rebalance)

    def _rebalance(self) -> None:
        self._rebalancing = False
        if self.owner is not None and self.owner in self.members:
            return
        for member in self.members:
            if not member.left and member.alive():
                self.owner = member
                member.events.append("assign")
                return
