"""One simulated harvester process of one table: the production Harvester (its core, driver and lifecycle)
over the world's I/O (engine.py), on the world's clock.

The driver's turns, the database sessions' jobs, the delivery reports and the leader election's
polls are world events, in the same order of threads the real harvester has (runtime.py): each
database session runs its jobs one at a time with a latency; the election thread runs the
production step (neli.ElectionPoll over the production neli.LeaderElection: its heartbeats, their
signature and age) every min_poll_interval, over the world's leader topic, and blocks in a revoke
until the core lets partition 0 go (election_thread.py).

The process can be paused (SIGSTOP: nothing runs, librdkafka included), crash (its database
sessions end, its group membership times out), stop gracefully (Harvester.stop; the process exits
once the harvester ended), and lose its network to Kafka's leader-election broker, to the record
brokers, or to Postgres.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.core import Core
from outbox.harvest.driver import Driver
from outbox.harvest.kafka import leader_consumer_config
from outbox.harvest.memory_table import MemoryStore, MemoryTable
from outbox.harvest.neli import ElectionPoll, LeaderElection
from outbox.kafka.memory.broker import MemoryBroker
from outbox.kafka.memory.world import SimWorld
from tests.sim.election_thread import HeartbeatProducer, LinkedConsumer
from tests.sim.engine import EngineHost, SimHarvester


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


class SimReplica:
    """One `manage.py harvest` process of one table: the production Harvester (engine.py) over the world's leader
    topic, table and record brokers."""

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
        self.leader_topic = f"leader-{group}"
        kafka.create_topic(self.leader_topic, 1)
        # The production consumer's settings (its session timeout is three heartbeat timeouts). The coordinator
        # may give partition 0 to a replica that joins (a hand-over while the group scales out).
        config = HarvestConfig(dsn="postgresql://sim/sim", leader_topic=self.leader_topic, leader_group=group,
                               name=name, limits=limits, status_table=None, park_after=park_after)
        consumer_config = leader_consumer_config(config)
        kafka.consumer_group(group, [self.leader_topic], consumer_config["session.timeout.ms"] / 1000,
                             move_chance=0.3)
        self.consumer = LinkedConsumer(kafka, consumer_config, name=name,
                                       alive=lambda: self.process_running() and self.links.leader,
                                       linked=lambda: self.links.leader)
        store = MemoryStore(table, name, group, reachable=lambda: self.links.database)
        self.election = LeaderElection(self.leader_topic, name, self.consumer, HeartbeatProducer(self),
                                       max_age=limits.heartbeat_timeout, clock=lambda: int(world.now * 1e9))
        self.engine = EngineHost(self, name, config, store, self.election, core_factory=core_factory,
                                 driver_factory=driver_factory, election_poll_class=election_poll_class,
                                 on_closed=self._ended)

    @property
    def harvester(self) -> SimHarvester:
        return self.engine.harvester

    @property
    def core(self) -> Core:
        return self.engine.harvester.core

    @property
    def store(self) -> MemoryStore:
        return self.engine.store

    # -- the process ----------------------------------------------------------------------------

    def process_running(self) -> bool:
        return self.running and not self.crashed and self.world.now >= self.paused_until

    def start(self) -> None:
        self.running = True
        self.harvester.start()

    def pause(self, seconds: float) -> None:
        """SIGSTOP for `seconds`, then SIGCONT."""
        if not self.process_running():
            return
        self.world.note(f"{self.name} paused for {seconds:.2f}s")
        self.paused_until = self.world.now + seconds
        self.engine.paused()
        self.world.at(self.paused_until, self.engine.wake)

    def crash(self) -> None:
        """SIGKILL: everything in memory is gone; sessions end; Kafka notices after the session timeout."""
        if self.crashed or not self.running:
            return
        self.world.note(f"{self.name} crashed")
        self.crashed = True
        self.engine.crash()

    def stop(self) -> None:
        """SIGTERM (Harvester.stop): the core stops marking and sending; once it has finished, the harvester closes
        (its election thread leaves the group) and the process exits."""
        if not self.process_running() or self.stopped:
            return
        self.world.note(f"{self.name} stopping")
        self.stopped = True
        self.harvester.stop()

    def _ended(self, engine: EngineHost) -> None:
        self.running = False
