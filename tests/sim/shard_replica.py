"""One simulated sharded harvester process (`harvest --shards N`, outbox/harvest/shards.py): one group
consumer of the leader topic, and an engine (the real Core and the real Driver) for each shard it is given.

What runs is the real code where it can be stepped: the process's `shards.ShardedHarvester` itself (its
open() and its manager's step, tick(): what the group assigned, the real supervisor.Supervisor, the real
shards.retires), the group's rebalance callbacks and its table of shards (`shards.ShardGroup`, not
started as a thread), each engine's view of its shard (`shards.ShardElection`: its events, its own
heartbeats, `gone`), and the core and driver of every engine. What the harvester would do with Postgres
and Kafka to join its group, and its engines' real I/O, are the world's (SimShardedHarvester). The
threads are world events, as in replica.py: the group thread consumes the leader topic every
min_poll_interval through the memory consumer (groups.py: cooperative-sticky, so a moving partition is
revoked, the callback returns at once, as ShardGroup's does, and then assigned to its new owner); each
engine's election thread runs the production step (neli.ElectionPoll) over its ShardElection, blocking
in a revoke until the core answers ReleasePartition (election_thread.py); the manager thread runs the
harvester's tick() every MANAGE_INTERVAL (an engine started on assignment, stopped once its revoke
settled or its shard was lost).

The process can crash, pause (SIGSTOP), stop gracefully (every engine settles, then the consumer
leaves the group) and lose its links to the leader topic, the record brokers or Postgres; an engine's
thread can fail (the supervisor then restarts it after a backoff). Its status thread writes each engine's
row (status_table.py) as the production status code makes it from the engine's core.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import methodcaller
from types import SimpleNamespace
from typing import Any

from outbox.harvest import sharding, status
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.core import Core
from outbox.harvest.driver import Driver
from outbox.harvest.harvester import HarvestError, State
from outbox.harvest.kafka import leader_consumer_config
from outbox.harvest.memory_table import MemoryStore, MemoryTable
from outbox.harvest.shards import MANAGE_INTERVAL, ShardedHarvester, ShardElection, ShardGroup
from outbox.harvest.supervisor import RESTART_BACKOFF, Supervisor
from outbox.kafka.memory.broker import MemoryBroker, MemoryProducer
from outbox.kafka.memory.world import SimWorld, Violation
from tests.sim.election_thread import HeartbeatProducer, LinkedConsumer, SimElectionThread
from tests.sim.replica import Links, Log, SimIO
from tests.sim.status_table import EPOCH, REPORT_EVERY, StatusTable

#: The engine whose turn runs now (a trace's log lines name it).
RUNNING: list[str] = [""]


class ShardEngine:
    """One shard's engine (a Harvester in shards.py): the real Core(handoff_by_fence=True) and Driver over
    SimIO, its own database sessions and record producer, and its election thread over a ShardElection."""

    def __init__(self, replica: ShardedReplica, shard: int, number: int) -> None:
        self.replica = replica
        self.shard = shard
        self.world = replica.world
        self.name = f"{replica.name}-s{shard}#{number}"
        self.limits = replica.limits
        self.kafka = replica.kafka
        self.table = replica.table
        self.log = replica.log
        self.links = replica.links
        self.store = MemoryStore(replica.table, self.name, replica.group_name, reachable=lambda: replica.links.database,
                                 shards=replica.shards, shard=shard)
        self.core = replica.core_factory(replica.limits, new_leader_id=self.world.uuid, park_after=replica.park_after,
                                         now=self.world.now, handoff_by_fence=True)
        self.core.checking = True
        self._busy_until = {"fence": 0.0, "purge": 0.0}
        self.io = SimIO(self)  # type: ignore[arg-type]  # duck-typed: the attributes SimIO reads are here
        self.driver = replica.driver_factory(self.core, self.io)
        self.driver.wake = lambda: self._wake(0.0)
        self.election = ShardElection(replica.group, shard, self.name)
        self.election_thread = SimElectionThread(self, self.election, self.driver.post, self.limits.min_poll_interval)
        #: What its status row says it is (the engine's HarvestConfig, as far as the row reads it).
        self.config = SimpleNamespace(name=sharding.engine_name(replica.name, shard), table="outbox",
                                      leader_topic=replica.leader_topic, leader_group=replica.group_name,
                                      shard=shard, shards=replica.shards)
        self.state = State.RUNNING  # RUNNING, STOPPING, STOPPED: Harvester's lifecycle, as the supervisor reads it
        #: Why the engine failed (its wait() re-raises it, as Harvester.wait does), if it did.
        self.failure: str | None = None
        self._wake_at: float | None = None
        self._last_turn = -1.0
        self._spins = 0

    # -- what SimIO reads -----------------------------------------------------------------------

    @property
    def crashed(self) -> bool:
        return self.replica.crashed or self.state is State.STOPPED

    @property
    def slow_until(self) -> float:
        return self.replica.slow_until

    @property
    def paused_until(self) -> float:
        return self.replica.paused_until

    def process_running(self) -> bool:
        return self.replica.process_running()

    def new_producer(self) -> MemoryProducer:
        pipelined = self.limits.max_in_flight_per_key > 1
        replica = self.replica
        return MemoryProducer(self.kafka, self.name, gapless=pipelined,
                              delivery_timeout=None if pipelined else self.limits.delivery_timeout,
                              is_running=replica.process_running, can_reach=lambda: replica.links.records)

    def on_session(self, name: str, job: Callable[[], None]) -> None:
        """Each session runs one statement at a time, with a latency (replica.SimReplica.on_session)."""
        faults = self.table.faults
        start = max(self.world.now, self._busy_until[name])
        slow = self.world.now < self.replica.slow_until or self.world.chance(faults.slow)
        finish = start + self.world.latency(*(faults.slow_latency if slow else faults.latency))
        self._busy_until[name] = finish

        def execute() -> None:
            if not self.crashed:
                job()
        self.world.at(finish, execute)

    # -- life (Harvester.start / stop / its engine thread) -----------------------------------------

    def start(self) -> None:
        replica = self.replica
        self.election_thread.start()
        self._wake(0.0)
        self.world.note(f"{self.name} started (shard {self.shard} of {replica.shards})")

    def stop(self) -> None:
        """Harvester.stop: the core stops (settling what is in flight, bounded), then everything closes."""
        if self.state is State.RUNNING:
            self.state = State.STOPPING
            self.driver.post(methodcaller("stop"))
            self._wake(0.0)

    def wait(self, timeout: float | None = None) -> bool:
        """Harvester.wait: True once stopped, re-raising a failure as HarvestError."""
        if self.state is State.STOPPED and self.failure is not None:
            raise HarvestError(f"harvester failed: {self.failure}")
        return self.state is State.STOPPED

    def fail(self, why: str) -> None:
        """The engine thread raised (Harvester._run's `except`): everything closes at once, its fence with its
        sessions, and what was not transmitted is gone; wait() re-raises it, and the supervisor starts the
        shard's engine again after its backoff."""
        if self.crashed or self.state is State.STOPPED:
            return
        self.failure = why
        self.world.note(f"{self.name} failed: {why}")
        self.replica.failed_at[self.shard] = self.world.now
        self._close()

    def crash(self) -> None:
        self.store.close()
        self.io.producer.purge()  # what was not transmitted is gone with the process
        self.io.producer.close()

    def _close(self) -> None:
        """The engine thread's end (ThreadedIO.close): the election thread stops (a revoke callback under way
        returns at once), the producer, then the store's sessions (the fence goes with them)."""
        self.election_thread.stop()
        self.io.producer.purge()  # a stopped core has nothing in flight, or gave it up: nothing is left
        self.io.producer.close()
        self.store.close()
        self.state = State.STOPPED
        self.replica.status.forget(self.config.name)
        self.world.note(f"{self.name} stopped")

    # -- the engine thread ------------------------------------------------------------------------

    def _wake(self, delay: float) -> None:
        if self.crashed:
            return
        when = self.world.now + max(0.0, delay)
        if self._wake_at is not None and self._wake_at <= when:
            return
        self._wake_at = when
        self.world.at(when, lambda: self._turn(when))

    def resumed(self) -> None:
        """SIGCONT: the engine thread runs at once."""
        self._wake_at = None
        self._wake(0.0)

    def _turn(self, scheduled: float) -> None:
        if self._wake_at != scheduled:
            return
        self._wake_at = None
        if self.crashed or not self.replica.process_running():
            return
        if scheduled == self._last_turn:
            self._spins += 1
            if self._spins > 10_000:
                raise Violation(f"{self.name}: the core keeps asking to run again at once (phase "
                                f"{self.core.phase.value}, deadline {self.core.next_deadline()})")
        else:
            self._last_turn, self._spins = scheduled, 0
        RUNNING[0] = self.name
        deadline = self.driver.turn()
        RUNNING[0] = ""
        if self.core.finished:
            self._close()
            return
        self._wake(deadline - self.world.now)


class ShardedReplica:
    """One `harvest --shards N` process (ShardedHarvester)."""

    def __init__(self, world: SimWorld, name: str, group: str, shards: int, limits: Limits, kafka: MemoryBroker,
                 table: MemoryTable, log: Log, *, park_after: int | None = None,
                 core_factory: Callable[..., Core] = Core, driver_factory: Callable[..., Driver] = Driver,
                 supervisor_class: type[Supervisor[int, ShardEngine]] = Supervisor,
                 status_table: StatusTable | None = None) -> None:
        self.world = world
        self.name = name
        self.group_name = group
        self.shards = shards
        self.limits = limits
        self.kafka = kafka
        self.table = table
        self.log = log
        self.park_after = park_after
        self.core_factory, self.driver_factory = core_factory, driver_factory
        self.links = Links()
        self.status = status_table if status_table is not None else StatusTable(world)
        self.running = False
        self.crashed = False
        self.stopped = False  # asked to stop
        self.finished = False  # stopped: its engines settled and its consumer left the group
        self.paused_until = 0.0
        self.slow_until = 0.0
        self.leader_topic = f"leader-{group}"
        kafka.create_topic(self.leader_topic, shards)
        config = HarvestConfig(dsn="postgresql://sim/sim", leader_topic=self.leader_topic, leader_group=group,
                               name=name, limits=limits, status_table=None, shards=shards, park_after=park_after)
        self.consumer = LinkedConsumer(kafka, leader_consumer_config(config), name=name,
                                       alive=lambda: self.process_running() and self.links.leader,
                                       linked=lambda: self.links.leader)
        self.group = SteppedGroup(config, self.consumer, HeartbeatProducer(self),  # type: ignore[arg-type]
                                  clock=lambda: self.world.now)
        self.harvester = SimShardedHarvester(self, config, supervisor_class=supervisor_class)
        self._numbers = 0
        #: Every engine this process started (the world's view of its threads: the supervisor's may forget one).
        self.started: list[ShardEngine] = []
        #: When the engine of a shard this replica has owned since then failed.
        self.failed_at: dict[int, float] = {}
        #: Engines started too early: within the restart backoff, or beside one of their shard that had not
        #: stopped (the scenario's watch reports them).
        self.restarted_early: list[str] = []

    @property
    def engines(self) -> dict[int, ShardEngine]:
        return self.harvester.engines  # type: ignore[return-value]

    def process_running(self) -> bool:
        return self.running and not self.crashed and self.world.now >= self.paused_until

    @property
    def live(self) -> bool:
        return self.running and not self.crashed and not self.stopped

    # -- the process ------------------------------------------------------------------------------

    def start(self) -> None:
        self.running = True
        self.harvester.open()
        self.group.subscribe()
        self.world.note(f"{self.name} started ({self.shards} shards)")
        self.world.after(0.0, self._poll_group)
        self.world.after(0.0, self._manage)
        self.world.after(0.0, self._report)

    def pause(self, seconds: float) -> None:
        """SIGSTOP for `seconds`, then SIGCONT."""
        if not self.process_running():
            return
        self.world.note(f"{self.name} paused for {seconds:.2f}s")
        self.paused_until = self.world.now + seconds

        def resume() -> None:
            for engine in list(self.engines.values()):
                engine.resumed()
        self.world.at(self.paused_until, resume)

    def crash(self) -> None:
        """SIGKILL: its sessions end, its producers' unsent records are gone; Kafka notices in a session timeout."""
        if self.crashed or not self.running:
            return
        self.world.note(f"{self.name} crashed")
        self.crashed = True
        for engine in self.engines.values():
            engine.crash()

    def stop(self) -> None:
        """SIGTERM (ShardedHarvester.stop): every engine settles and stops; then the consumer leaves the group."""
        if not self.process_running() or self.stopped:
            return
        self.world.note(f"{self.name} stopping")
        self.stopped = True

    # -- the group thread (ShardGroup.run) --------------------------------------------------------

    def _poll_group(self) -> None:
        """The group's thread (ShardGroup.run): its step until the harvester asks it to stop, then its end (the
        consumer leaves the group: the shards move at once)."""
        if self.crashed:
            return
        if self.world.now < self.paused_until:
            self.world.at(self.paused_until, self._poll_group)
            return
        if self.group.stopping:
            self.group.end()
            return
        self.group.step()
        self.world.after(self.limits.min_poll_interval, self._poll_group)

    # -- the engines' status rows (status_board.StatusBoard) --------------------------------------------

    def _report(self) -> None:
        """Each engine that has not stopped writes its row, from its core's snapshot (Harvester.status)."""
        if self.crashed or self.finished:
            return
        if not self.process_running():
            self.world.at(self.paused_until, self._report)
            return
        for engine in list(self.engines_not_stopped()):
            snapshot = status.snapshot_of(engine.core.snapshot(), stopping=engine.state is State.STOPPING,
                                          since=EPOCH, throughput=0.0, round_trips={})
            self.status.write(self.name, engine.config, snapshot)
        self.world.after(REPORT_EVERY, self._report)

    # -- the manager thread (ShardedHarvester._manage) ------------------------------------------------

    def _manage(self) -> None:
        if self.crashed or self.finished:
            return
        if not self.process_running():
            self.world.at(self.paused_until, self._manage)
            return
        if self.stopped:
            if self.harvester.end_step():  # the manager's end (EngineSet._manage's finally)
                self.finished = True
                self.running = False
                self.world.note(f"{self.name} stopped")
        else:
            for shard in [shard for shard in self.failed_at if shard not in self.group.owned()]:
                del self.failed_at[shard]  # the shard went: its next engine is a new start, not a restart
            self.harvester.tick()
        if not self.finished:
            self.world.after(MANAGE_INTERVAL, self._manage)

    def new_engine(self, shard: int) -> ShardEngine:
        """The harvester's new engine for `shard` (its start() follows), watched for starts that came too early."""
        failed_at = self.failed_at.pop(shard, None)
        if failed_at is not None and self.world.now - failed_at < RESTART_BACKOFF:
            # Said by the scenario's watch: a Violation raised here would be an engine that cannot start.
            self.restarted_early.append(f"{self.name} started shard {shard}'s engine again "
                                        f"{self.world.now - failed_at:.2f}s after it failed, within the restart "
                                        f"backoff ({RESTART_BACKOFF:g}s)")
        settling = [engine.name for engine in self.engines_not_stopped() if engine.shard == shard]
        if settling:
            self.restarted_early.append(f"{self.name} started an engine of shard {shard} while "
                                        f"{', '.join(settling)} had not stopped")
        self._numbers += 1
        engine = ShardEngine(self, shard, self._numbers)
        self.started.append(engine)
        return engine

    def engines_not_stopped(self) -> list[ShardEngine]:
        """The engines this process started that have not stopped (the supervisor's view aside)."""
        self.started = [engine for engine in self.started if engine.state is not State.STOPPED]
        return self.started

class SteppedGroup(ShardGroup):
    """The replica's ShardGroup, not a thread: the world runs its polls (ShardedReplica._poll_group)."""

    def start(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        """No thread to wait for: the world runs its end() once it is asked to stop (ShardedReplica._poll_group)."""


class SimShardedHarvester(ShardedHarvester):
    """The production sharded harvester, joined to the world's group and running the world's engines: what it
    does with Postgres and Kafka to join (the shard index, the leader topic, the clients) and its engines' real
    I/O are what the simulator models; its open(), step and rules are the production code's."""

    def __init__(self, replica: ShardedReplica, config: HarvestConfig, **kwargs: Any) -> None:
        super().__init__(config, clock=lambda: replica.world.now, **kwargs)
        self.replica = replica

    def _join_group(self) -> ShardGroup:
        return self.replica.group

    def _new_engine(self, shard: int) -> ShardEngine:  # type: ignore[override]
        return self.replica.new_engine(shard)

    def _election(self, shard: int, engine: ShardEngine) -> ShardElection:  # type: ignore[override]
        return engine.election
