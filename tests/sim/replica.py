"""One simulated harvester process: the real Core and the real Driver (outbox/harvest/driver.py),
over simulated I/O on the world's clock.

The driver's turns, the database sessions' jobs, the delivery reports and the leader election's
polls are world events, in the same order of threads the real harvester has (runtime.py): each
database session runs its jobs one at a time with a latency; the election thread runs the
production step (neli.ElectionPoll over the production neli.LeaderElection: its heartbeats, their
signature and age) every min_poll_interval, over the world's leader topic, and blocks in a revoke
until the core lets partition 0 go (election_thread.py).

The process can be paused (SIGSTOP: nothing runs, librdkafka included), crash (its database
sessions end, its group membership times out), stop gracefully, and lose its network to Kafka's
leader-election broker, to the record brokers, or to Postgres.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from operator import methodcaller

from outbox.harvest import events
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.connector import Store
from outbox.harvest.contract import Record
from outbox.harvest.core import Core
from outbox.harvest.driver import Driver
from outbox.harvest.kafka import leader_consumer_config
from outbox.harvest.memory_table import MemoryStore, MemoryTable
from outbox.harvest.neli import ElectionPoll, LeaderElection
from outbox.kafka.memory.broker import MemoryBroker, MemoryProducer
from outbox.kafka.memory.world import SimWorld, Violation
from outbox.kafka.sizes import UNLIMITED, batch_size_for
from tests.sim.election_thread import HeartbeatProducer, LinkedConsumer, SimElectionThread


@dataclass
class Links:
    leader: bool = True  # to the leader topic's broker and the group coordinator
    records: bool = True  # to the brokers of the record topic
    database: bool = True


@dataclass
class Log:
    """What the run's checks need from every replica."""

    leader_ids: list[tuple[str, object]] = field(default_factory=list)
    events: list[tuple[float, str, str]] = field(default_factory=list)


class SimIO:
    """The driver's EngineIO in the simulated world."""

    def __init__(self, replica: SimReplica) -> None:
        self._replica = replica
        self.batch_limit = UNLIMITED
        self.producer: MemoryProducer = self._new_producer()
        self._retiring: list[MemoryProducer] = []
        #: Topics' max.message.bytes as this replica last read them (the broker's `max_message_bytes`),
        #: read a moment after first asked for, again every topic_limits_interval and after a refusal.
        self._limits: dict[str, int] = {}
        self._reading: set[str] = set()

    def now(self) -> float:
        return self._replica.world.now

    def _new_producer(self) -> MemoryProducer:
        producer = self._replica.new_producer()
        if self.batch_limit < UNLIMITED:
            producer.batch_bytes = batch_size_for(self.batch_limit)
        return producer

    def topic_limit(self, topic: str) -> int | None:
        if topic not in self._limits:
            self._read_limit(topic)
        return self._limits.get(topic)

    def _read_limit(self, topic: str) -> None:
        """An admin request for the topic's configuration, answered a moment later."""
        replica = self._replica
        if topic in self._reading:
            return
        self._reading.add(topic)

        def answered() -> None:
            self._reading.discard(topic)
            if replica.crashed:
                return
            self._limits[topic] = replica.kafka.max_message_bytes.get(topic, UNLIMITED)
            replica.world.after(replica.limits.topic_limits_interval, lambda: self._read_limit(topic))
        replica.world.after(replica.world.latency(0.001, 0.02), answered)

    def fit_batches(self, limit: int) -> bool:
        if limit >= self.batch_limit:
            return True
        if len(self.producer) or self._retiring:
            return False
        self.batch_limit = limit
        self.producer = self._new_producer()
        return True

    def refused_for_size(self, topic: str | None) -> None:
        for name in [topic] if topic is not None else list(self._limits):
            self._read_limit(name)

    def submit(self, session: str, job: Callable[[Store], None]) -> None:
        replica = self._replica
        replica.on_session(session, lambda: job(replica.store))

    def restart_producer(self) -> None:
        old = self.producer
        old.purge()
        self._retiring.append(old)
        self.producer = self._new_producer()
        self._replica.world.after(0.001, self._serve_retiring)

    def _serve_retiring(self) -> None:
        """The delivery thread, polling the old producer until it has reported everything."""
        replica = self._replica
        if replica.crashed:
            return
        for old in list(self._retiring):
            if len(old) == 0:
                self._retiring.remove(old)
                replica.driver.post(methodcaller("on_producer_restarted"))
        if self._retiring:
            replica.world.after(0.005, self._serve_retiring)

    def publish_dead_letter(self, record: Record, reason: str) -> str | None:
        return None

    def release_partition(self) -> None:
        self._replica.election_thread.released()

    def leadership(self, *, assigned: bool, leading: bool) -> None:
        self._replica.election_thread.poll.heartbeat = assigned

    def announce(self, event: events.Event) -> None:
        replica = self._replica
        replica.log.events.append((replica.world.now, replica.name, type(event).__name__))
        if isinstance(event, events.LeaderAcquired | events.LeaderRefreshed):
            replica.log.leader_ids.append((replica.name, event.leader_id))
        replica.world.note(f"{replica.name} {event}")


class SimReplica:
    def __init__(self, world: SimWorld, name: str, group: str, limits: Limits, kafka: MemoryBroker,
                 table: MemoryTable, log: Log, *, park_after: int | None = None,
                 core_factory: Callable[..., Core] = Core,
                 driver_factory: Callable[..., Driver] = Driver,
                 election_poll_class: type[ElectionPoll] = ElectionPoll) -> None:
        self.world = world
        self.name = name
        self.group_name = group
        self.limits = limits
        self.kafka = kafka
        self.table = table
        self.log = log
        self.running = False
        self.crashed = False
        self.stopped = False
        self.paused_until = 0.0
        self.links = Links()
        self.slow_until = 0.0  # its database statements crawl until then
        self.core = core_factory(limits, new_leader_id=world.uuid, park_after=park_after, now=world.now)
        self.core.checking = True
        self.leader_topic = f"leader-{group}"
        kafka.create_topic(self.leader_topic, 1)
        # The production consumer's settings (its session timeout is three heartbeat timeouts). The coordinator
        # may give partition 0 to a replica that joins (a hand-over while the group scales out).
        config = HarvestConfig(dsn="postgresql://sim/sim", leader_topic=self.leader_topic, leader_group=group,
                               name=name, limits=limits, status_table=None)
        consumer_config = leader_consumer_config(config)
        kafka.consumer_group(group, [self.leader_topic], consumer_config["session.timeout.ms"] / 1000,
                             move_chance=0.3)
        self.consumer = LinkedConsumer(kafka, consumer_config, name=name,
                                       alive=lambda: self.process_running() and self.links.leader,
                                       linked=lambda: self.links.leader)
        self.store = MemoryStore(table, name, group, reachable=lambda: self.links.database)
        self._busy_until = {"fence": 0.0, "purge": 0.0}
        self.io = SimIO(self)
        self.driver = driver_factory(self.core, self.io)
        self.driver.wake = lambda: self._wake(0.0)
        self.election = LeaderElection(self.leader_topic, name, self.consumer, HeartbeatProducer(self),
                                       max_age=limits.heartbeat_timeout, clock=lambda: int(world.now * 1e9))
        self.election_thread = SimElectionThread(self, self.election, self.driver.post, limits.min_poll_interval,
                                                 election_poll_class)
        self._wake_at: float | None = None
        self._last_turn = -1.0
        self._spins = 0

    # -- the process ----------------------------------------------------------------------------

    def process_running(self) -> bool:
        return self.running and not self.crashed and self.world.now >= self.paused_until

    def start(self) -> None:
        self.running = True
        self.election_thread.start()
        self._wake(0.0)

    def pause(self, seconds: float) -> None:
        """SIGSTOP for `seconds`, then SIGCONT."""
        if not self.process_running():
            return
        self.world.note(f"{self.name} paused for {seconds:.2f}s")
        self.paused_until = self.world.now + seconds
        self._wake_at = None
        self.world.at(self.paused_until, lambda: self._wake(0.0))

    def crash(self) -> None:
        """SIGKILL: everything in memory is gone; sessions end; Kafka notices after the session timeout."""
        if self.crashed or not self.running:
            return
        self.world.note(f"{self.name} crashed")
        self.crashed = True
        self.store.close()
        self.io.producer.purge()  # what was not transmitted is gone with the process
        self.io.producer.close()

    def stop(self) -> None:
        """SIGTERM: the core stops marking and sending; once it has finished, the replica leaves the group."""
        if not self.process_running() or self.stopped:
            return
        self.world.note(f"{self.name} stopping")
        self.stopped = True
        self.driver.post(methodcaller("stop"))

    def new_producer(self) -> MemoryProducer:
        pipelined = self.limits.max_in_flight_per_key > 1
        return MemoryProducer(self.kafka, self.name, gapless=pipelined,
                           delivery_timeout=None if pipelined else self.limits.delivery_timeout,
                           is_running=self.process_running, can_reach=lambda: self.links.records)

    # -- the engine thread ----------------------------------------------------------------------

    def _wake(self, delay: float) -> None:
        if self.crashed:
            return
        when = self.world.now + max(0.0, delay)
        if self._wake_at is not None and self._wake_at <= when:
            return
        self._wake_at = when
        self.world.at(when, lambda: self._turn(when))

    def _turn(self, scheduled: float) -> None:
        if self._wake_at != scheduled:
            return  # superseded by an earlier wake
        self._wake_at = None
        if not self.process_running():
            return
        if scheduled == self._last_turn:
            self._spins += 1
            if self._spins > 10_000:
                raise Violation(f"{self.name}: the core keeps asking to run again at once (phase "
                                f"{self.core.phase.value}, deadline {self.core.next_deadline()})")
        else:
            self._last_turn, self._spins = scheduled, 0
        deadline = self.driver.turn()
        if self.core.finished:
            self._leave()
            return
        self._wake(deadline - self.world.now)

    def _leave(self) -> None:
        """The harvester closes: the election thread leaves the group (its revoke callback returns at once),
        and the store's sessions end."""
        self.election_thread.stop()
        self.store.close()
        self.running = False
        self.world.note(f"{self.name} stopped")

    # -- the database sessions ------------------------------------------------------------------

    def on_session(self, name: str, job: Callable[[], None]) -> None:
        """Each session runs one statement at a time, with a latency (now and then a long one)."""
        faults = self.table.faults
        start = max(self.world.now, self._busy_until[name])
        slow = self.world.now < self.slow_until or self.world.chance(faults.slow)
        finish = start + self.world.latency(*(faults.slow_latency if slow else faults.latency))
        self._busy_until[name] = finish

        def execute() -> None:
            if not self.crashed:
                job()
        self.world.at(finish, execute)
