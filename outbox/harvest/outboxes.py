"""Many outboxes in one process: an engine per outbox, started, restarted and stopped by a supervisor.

    harvester = ManyHarvester(discover)       # discover() -> {label: HarvestConfig}, one per outbox
    harvester.start(); ...; harvester.stop(); harvester.wait()

Each outbox (a table in some database: several databases, several tables, or the outbox table of
every tenant schema, tenants.py) is harvested as if by a process of its own: its own leader topic and
group (or shards, shards.py), fence, leader ids, producer and status row (its engine's name is this
process's name and the outbox's label, `replica-a/acme`). What they share is the process, the LISTEN
session of each database (notify_hub.py: a NOTIFY wakes the engine of the table that was written) and
the status writer of each status table (status_board.py: every engine's row in one statement), so an
idle outbox costs no session of its own for either and, with the safety-net poll made rarer
(`idle_poll_interval`, outbox/many.py), next to no queries.

The manager thread asks `discover` for the outboxes at start and every `rescan_interval`, and
reconciles them with its engines (supervisor.py): an outbox that appears gets an engine (a tenant
schema created while running is picked up), one that disappears or changes has its engine stopped
(it settles first). An engine that fails is logged and started again after a backoff that doubles:
one broken outbox never stops the others, and the process stops only when asked to. The simulator
(tests/sim/many_process.py) runs the same `open()` and `tick()` on its clock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from outbox.harvest import events
from outbox.harvest.config import HarvestConfig
from outbox.harvest.connector import LiveConnector
from outbox.harvest.harvester import Harvester, HarvestError, State
from outbox.harvest.instruments import Instruments
from outbox.harvest.notify_hub import NotifyHubs
from outbox.harvest.shards import ShardedHarvester
from outbox.harvest.status import StatusSnapshot
from outbox.harvest.status_board import BoardReporter, StatusBoards
from outbox.harvest.store import PostgresStore
from outbox.harvest.supervisor import EngineSet, RunningEngine, Supervisor
from outbox.harvest.tracing import PublishTracer
from outbox.reasons import first_line

log = logging.getLogger("outbox.harvest.outboxes")

#: How often the manager looks at its engines.
MANAGE_INTERVAL = 0.1
#: How often the outboxes are discovered again (new tenant schemas, dropped ones), by default.
RESCAN_INTERVAL = 30.0


class Engine(RunningEngine, Protocol):
    """What the set needs of an outbox's engine (Harvester and ShardedHarvester are two)."""

    config: HarvestConfig

    def start(self) -> None: ...


class RestingStore(PostgresStore):
    """A store whose fence session is closed while it holds no fence: of fifty outboxes' engines, the
    standbys need no session (take_fence opens one again when the engine comes to lead). Both calls run
    where the fence session's jobs run (the fence worker, or before it starts)."""

    def has_notify_trigger(self) -> bool:
        found = super().has_notify_trigger()
        self._rest()
        return found

    def release_fence(self, *, settled: bool = True) -> None:
        super().release_fence(settled=settled)
        self._rest()

    def _rest(self) -> None:
        if not self._fence_held:
            self._drop_fence()


class ManyConnector(LiveConnector):
    """The live connector of one outbox's engine among many: its LISTEN goes through its database's shared
    hub (notify_hub.py), its status row onto the shared board (status_board.py), and its fence session is
    open only while it leads (RestingStore)."""

    store_class = RestingStore

    def __init__(self, config: HarvestConfig, hubs: NotifyHubs, boards: StatusBoards) -> None:
        super().__init__(config, hubs, boards)

    def status_reporter(self, snapshot: Callable[[], StatusSnapshot], on_backlog: Callable[[int], None], *,
                        sharded_replica: bool = False) -> BoardReporter | None:
        return self.boards.reporter(self.config, snapshot, on_backlog, one_of_many=True)


class ManyHarvester(EngineSet[str, Engine]):
    """Harvests every outbox `discover` names, an engine each, in this process (module docstring)."""

    manage_interval = MANAGE_INTERVAL
    thread_name = "outbox-outboxes"

    def __init__(self, discover: Callable[[], dict[str, HarvestConfig]], *, name: str = "",
                 rescan_interval: float = RESCAN_INTERVAL,
                 engine_factory: Callable[[str, HarvestConfig], Engine] | None = None,
                 on_event: Callable[[Any, events.Event], None] | None = None,
                 instruments: Callable[[str], Instruments] | None = None, tracer: PublishTracer | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 supervisor_class: type[Supervisor[str, Engine]] = Supervisor) -> None:
        """`supervisor_class`: the reconcile step's class (the simulator swaps in a deliberate bug)."""
        super().__init__(self._start_engine, describe=lambda label: f"Outbox {label}'s engine", name=name,
                         supervisor_class=supervisor_class, clock=clock)
        self._discover = discover
        self._rescan_interval = rescan_interval
        self._on_event = on_event
        self._instruments = instruments
        self._tracer = tracer
        self._factory = engine_factory or self._live_engine
        self._lock = threading.Lock()
        self._wanted: dict[str, HarvestConfig] = {}
        self._next_scan = 0.0
        self._scan_failing = False

    @property
    def outboxes(self) -> dict[str, HarvestConfig]:
        """The outboxes found by the last discovery, by label."""
        with self._lock:
            return dict(self._wanted)

    def discover(self) -> dict[str, HarvestConfig]:
        """The outboxes to harvest now, by label (what the supervisor asks every rescan_interval)."""
        return self._discover()

    def open(self) -> bool:
        """The first discovery (HarvestError if it fails), starting no thread: start() then runs tick() on the
        manager thread, the simulator on its clock. False if stop() came meanwhile."""
        if self._state is not State.CREATED:
            raise HarvestError(f"cannot start a harvester that is {self._state.value}")
        try:
            found = self._discover()
        except Exception as error:
            raise HarvestError(f"cannot find the outboxes to harvest: {first_line(error)}") from None
        with self._lock:
            self._wanted = dict(found)
        self._next_scan = self._clock() + self._rescan_interval
        if not found:
            log.warning("No outbox to harvest yet (looked again every %gs)", self._rescan_interval)
        with self._state_lock:
            if self._state is not State.CREATED:
                return False
            self._state = State.RUNNING
        log.info("Harvesting %d outbox(es) as %s: %s", len(found), self.name or "this process",
                 ", ".join(sorted(found)) or "none yet")
        return True

    # -- the step (supervisor.py): an engine for each outbox found; one whose outbox is gone or changed stops,
    # and a fresh one starts once it settled --------------------------------------------------------------

    def wanted(self, now: float) -> dict[str, HarvestConfig]:
        """Discover again when due: the outboxes found."""
        if now >= self._next_scan:
            self._next_scan = now + self._rescan_interval
            self._rescan()
        with self._lock:
            return dict(self._wanted)

    def retires(self, label: str, engine: Engine) -> bool:
        with self._lock:
            return self._wanted.get(label) != engine.config

    def _rescan(self) -> None:
        try:
            found = self._discover()
        except Exception as error:
            if not self._scan_failing:  # said once; the outboxes found before go on meanwhile
                log.warning("Cannot look for outboxes (the ones found before go on; looked again every %gs): %s",
                            self._rescan_interval, first_line(error))
            self._scan_failing = True
            return
        if self._scan_failing:
            log.info("Looking for outboxes works again")
        self._scan_failing = False
        with self._lock:
            before, self._wanted = self._wanted, dict(found)
        for label in sorted(set(found) - set(before)):
            log.info("Outbox %s found (%s)", label, found[label].table)
        for label in sorted(set(before) - set(found)):
            log.info("Outbox %s gone: its engine stops", label)

    def _start_engine(self, label: str) -> Engine:
        with self._lock:
            config = self._wanted[label]
        engine = self._factory(label, config)
        engine.start()
        return engine

    def _live_engine(self, label: str, config: HarvestConfig) -> Engine:
        """A Harvester whose LISTEN goes through the process's hub and whose status row is on the board (or a
        ShardedHarvester, whose engines listen through the same hub and report on the same board)."""
        if config.shards > 1:
            return ShardedHarvester(config, on_event=self._on_event, tracer=self._tracer,
                                    instruments=(lambda _shard: self._instruments(label))
                                    if self._instruments is not None else None, hubs=self.hubs,
                                    boards=self.boards)
        return Harvester.sending_events_to(
            self._on_event, config, connector=ManyConnector(config, self.hubs, self.boards), tracer=self._tracer,
            instruments=self._instruments(label) if self._instruments is not None else None)
