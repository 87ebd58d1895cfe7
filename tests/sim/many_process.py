"""One simulated process harvesting many outboxes (`harvest --outbox ...`, `--tenant-schemas`): the production
ManyHarvester, stepped on the world's clock.

What runs is the real code: `outboxes.ManyHarvester` (its first discovery by `open()`, then `tick()` every
MANAGE_INTERVAL of the process's running time, as its manager thread runs it: discovery again every
`rescan_interval`, the production `Supervisor` reconciling an engine per outbox found, an outbox that is gone
or changed retired once its engine settled, a failed engine started again after its backoff). Each outbox's
engine is one unsharded replica of its own (replica.py: the production Harvester over the world's I/O, its own
leader group, fence and producer), behind `OutboxEngine`, which names it after its outbox.

The process can crash (every engine with it) and pause; an engine's thread can fail on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.contract import ReplicaState
from outbox.harvest.core import Core
from outbox.harvest.harvester import HarvestError, State
from outbox.harvest.outboxes import MANAGE_INTERVAL, ManyHarvester
from outbox.harvest.supervisor import Supervisor
from outbox.kafka.memory.world import SimWorld
from tests.sim.replica import Log, SimReplica

#: The process looks for outboxes again this often (ManyHarvester's rescan_interval).
RESCAN_EVERY = 1.0


class Outbox:
    """One outbox of the world: its table, the Kafka cluster its records go to, and how it is configured."""

    def __init__(self, label: str, table: Any, kafka: Any, config: HarvestConfig) -> None:
        self.label, self.table, self.kafka, self.config = label, table, kafka, config


class OutboxEngine:
    """One outbox's engine in a process (a Harvester in outboxes.py): a SimReplica of its own (the production
    Harvester over its outbox's table, Kafka and leader group), as the supervisor meets it (start, state, stop,
    wait: the Harvester's own)."""

    def __init__(self, process: ManyProcess, outbox: Outbox, number: int) -> None:
        self.process = process
        self.label = outbox.label
        self.config = outbox.config
        self.name = f"{process.name}/{outbox.label}#{number}"
        self.replica = SimReplica(process.world, self.name, outbox.config.leader_group, process.limits, outbox.kafka,
                                  outbox.table, process.log, core_factory=process.core_factory)
        self.harvester = self.replica.harvester

    @property
    def state(self) -> State:
        return self.harvester.state

    @property
    def replica_state(self) -> ReplicaState:
        return self.harvester.replica_state

    @property
    def published(self) -> int:
        return self.harvester.published

    def start(self) -> None:
        self.replica.start()
        self.process.world.note(f"{self.name} started")

    def stop(self) -> None:
        self.replica.stop()

    def wait(self, timeout: float | None = None) -> bool:
        return self.harvester.wait(timeout)

    def fail(self, why: str) -> None:
        """A thread of its I/O dies: the Harvester ends the engine at its next step, and wait() re-raises."""
        self.replica.engine.fail(why)

    def crash(self) -> None:
        self.replica.crash()


class ManyProcess:
    """One `harvest --outbox ...` process: the production ManyHarvester over the world's outboxes."""

    def __init__(self, world: SimWorld, name: str, discover: Callable[[], dict[str, HarvestConfig]],
                 outboxes: Callable[[str], Outbox], limits: Limits, log: Log, *,
                 core_factory: Callable[..., Core] = Core,
                 harvester_class: type[ManyHarvester] = ManyHarvester,
                 supervisor_class: type[Supervisor[str, Any]] = Supervisor,
                 on_engine: Callable[[ManyProcess, str], None] = lambda process, label: None) -> None:
        """`on_engine(process, label)`: the supervisor starts an engine of `label` (the scenario's watch)."""
        self.world, self.name, self.limits, self.log = world, name, limits, log
        self.core_factory = core_factory
        self._on_engine = on_engine
        self._outbox = outboxes
        self.harvester = harvester_class(discover, name=name, rescan_interval=RESCAN_EVERY,
                                         engine_factory=self._engine, clock=lambda: world.now,
                                         supervisor_class=supervisor_class)
        self.crashed = False
        self.paused_until = 0.0
        #: Every engine this process started (the world's view of its threads).
        self.started: list[OutboxEngine] = []
        self._numbers = 0

    @property
    def engines(self) -> dict[str, Any]:
        return self.harvester.engines

    def process_running(self) -> bool:
        return not self.crashed and self.world.now >= self.paused_until

    def start(self) -> bool:
        """The process starts; False if it exited at once (its first discovery failed: `harvest` exits 1)."""
        try:
            opened = self.harvester.open()
        except HarvestError as error:
            self.world.note(f"{self.name} exited: {error}")
            self.crashed = True
            return False
        if opened:
            self.world.note(f"{self.name} started")
            self.world.after(0.0, self._tick)
        return True

    def _tick(self) -> None:
        """The manager thread's loop (ManyHarvester._manage): one tick every MANAGE_INTERVAL of running time."""
        if self.crashed:
            return
        if not self.process_running():
            self.world.at(self.paused_until, self._tick)
            return
        self.harvester.tick()
        self.world.after(MANAGE_INTERVAL, self._tick)

    def _engine(self, label: str, config: HarvestConfig) -> OutboxEngine:
        self._on_engine(self, label)
        self._numbers += 1
        engine = OutboxEngine(self, self._outbox(label), self._numbers)
        self.started.append(engine)
        return engine

    def pause(self, seconds: float) -> None:
        """SIGSTOP for `seconds`: the manager and every engine stand still."""
        if not self.process_running():
            return
        self.world.note(f"{self.name} paused for {seconds:.2f}s")
        self.paused_until = self.world.now + seconds
        for engine in self.started:
            if engine.state is not State.STOPPED:
                engine.replica.pause(seconds)

    def crash(self) -> None:
        """SIGKILL: every engine with it."""
        if self.crashed:
            return
        self.world.note(f"{self.name} crashed")
        self.crashed = True
        for engine in self.started:
            engine.crash()
