"""One simulated sharded harvester process (`harvest --shards N`, outbox/harvest/shards.py): one group
consumer of the leader topic, and an engine (the production Harvester, engine.py) for each shard it is given.

What runs is the real code where it can be stepped: the process's `shards.ShardedHarvester` itself (its
open() and its manager's step, tick(): what the group assigned, the real supervisor.Supervisor, the real
shards.retires), the group's rebalance callbacks and its table of shards (`shards.ShardGroup`, not
started as a thread), each engine's view of its shard (`shards.ShardElection`: its events, its own
heartbeats, `gone`), and every engine: a Harvester of the shard's configuration, its core, driver, step and
end. What the harvester would do with Postgres and Kafka to join its group, and its engines' real I/O, are the
world's (SimShardedHarvester, engine.EngineHost). The
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
row (status_table.py) from what the engine reports (Harvester.status), as the production status code makes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.core import Core
from outbox.harvest.driver import Driver
from outbox.harvest.harvester import Harvester, State
from outbox.harvest.kafka import leader_consumer_config
from outbox.harvest.memory_table import MemoryStore, MemoryTable
from outbox.harvest.shards import MANAGE_INTERVAL, ShardedHarvester, ShardElection, ShardGroup
from outbox.harvest.supervisor import RESTART_BACKOFF, Supervisor
from outbox.kafka.memory.broker import MemoryBroker
from outbox.kafka.memory.world import SimWorld
from tests.sim.election_thread import HeartbeatProducer, LinkedConsumer
from tests.sim.engine import EngineHost, SimHarvester
from tests.sim.replica import Links, Log
from tests.sim.status_table import REPORT_EVERY, StatusTable


class ShardedReplica:
    """One `harvest --shards N` process (ShardedHarvester)."""

    def __init__(self, world: SimWorld, name: str, group: str, shards: int, limits: Limits, kafka: MemoryBroker,
                 table: MemoryTable, log: Log, *, park_after: int | None = None,
                 core_factory: Callable[..., Core] = Core, driver_factory: Callable[..., Driver] = Driver,
                 supervisor_class: type[Supervisor[int, Harvester]] = Supervisor,
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
        self.started: list[SimHarvester] = []
        #: When the engine of a shard this replica has owned since then failed.
        self.failed_at: dict[int, float] = {}
        #: Engines started too early: within the restart backoff, or beside one of their shard that had not
        #: stopped (the scenario's watch reports them).
        self.restarted_early: list[str] = []

    @property
    def engines(self) -> dict[int, SimHarvester]:
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
                engine.host.resumed()
        self.world.at(self.paused_until, resume)

    def crash(self) -> None:
        """SIGKILL: its sessions end, its producers' unsent records are gone; Kafka notices in a session timeout."""
        if self.crashed or not self.running:
            return
        self.world.note(f"{self.name} crashed")
        self.crashed = True
        for engine in self.engines.values():
            engine.host.crash()

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
        """Each engine that has not stopped writes its row, from what it would report now (Harvester.status)."""
        if self.crashed or self.finished:
            return
        if not self.process_running():
            self.world.at(self.paused_until, self._report)
            return
        for engine in list(self.engines_not_stopped()):
            self.status.write(self.name, engine.config, engine.status())
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

    def new_engine(self, shard: int) -> SimHarvester:
        """The harvester's new engine for `shard` (its start() follows), watched for starts that came too early: the
        production Harvester of the shard's config (ShardedHarvester._engine_config) over the world's I/O."""
        failed_at = self.failed_at.pop(shard, None)
        if failed_at is not None and self.world.now - failed_at < RESTART_BACKOFF:
            # Said by the scenario's watch: a Violation raised here would be an engine that cannot start.
            self.restarted_early.append(f"{self.name} started shard {shard}'s engine again "
                                        f"{self.world.now - failed_at:.2f}s after it failed, within the restart "
                                        f"backoff ({RESTART_BACKOFF:g}s)")
        settling = [engine.name for engine in self.engines_not_stopped() if engine.config.shard == shard]
        if settling:
            self.restarted_early.append(f"{self.name} started an engine of shard {shard} while "
                                        f"{', '.join(settling)} had not stopped")
        self._numbers += 1
        name = f"{self.name}-s{shard}#{self._numbers}"
        store = MemoryStore(self.table, name, self.group_name, reachable=lambda: self.links.database,
                            shards=self.shards, shard=shard)
        host = EngineHost(self, name, self.harvester._engine_config(shard), store,
                          ShardElection(self.group, shard, name), core_factory=self.core_factory,
                          driver_factory=self.driver_factory, on_closed=self._engine_ended)
        self.started.append(host.harvester)
        return host.harvester

    def _engine_ended(self, host: EngineHost) -> None:
        """An engine closed (Harvester's end): its status row goes; a failed one's shard restarts after a backoff."""
        config = host.harvester.config
        if host.failure is not None:
            self.failed_at[config.shard] = self.world.now
        self.status.forget(config.name)

    def engines_not_stopped(self) -> list[SimHarvester]:
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

    def _new_engine(self, shard: int) -> SimHarvester:
        return self.replica.new_engine(shard)

    def _election(self, shard: int, engine: Harvester) -> ShardElection:
        assert isinstance(engine, SimHarvester)
        return engine.host.election  # type: ignore[return-value]
