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
from outbox.harvest.contract import ReplicaState
from outbox.harvest.harvester import Harvester, HarvestError, Lifecycle, State
from outbox.harvest.instruments import Instruments
from outbox.harvest.notify_hub import NotifyHubs
from outbox.harvest.shards import ShardedHarvester
from outbox.harvest.status import StatusSnapshot
from outbox.harvest.status_board import BoardReporter, StatusBoards
from outbox.harvest.store import PostgresStore
from outbox.harvest.supervisor import Supervisor
from outbox.harvest.tracing import PublishTracer
from outbox.reasons import first_line

log = logging.getLogger("outbox.harvest.outboxes")

#: How often the manager looks at its engines.
MANAGE_INTERVAL = 0.1
#: How often the outboxes are discovered again (new tenant schemas, dropped ones), by default.
RESCAN_INTERVAL = 30.0


class Engine(Protocol):
    """What the supervisor needs of an engine (Harvester and ShardedHarvester are two)."""

    config: HarvestConfig

    @property
    def state(self) -> State: ...
    @property
    def replica_state(self) -> ReplicaState: ...
    @property
    def published(self) -> int: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def wait(self, timeout: float | None = None) -> bool: ...


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


class ManyHarvester(Lifecycle):
    """Harvests every outbox `discover` names, an engine each, in this process (module docstring)."""

    def __init__(self, discover: Callable[[], dict[str, HarvestConfig]], *, name: str = "",
                 rescan_interval: float = RESCAN_INTERVAL,
                 engine_factory: Callable[[str, HarvestConfig], Engine] | None = None,
                 on_event: Callable[[Any, events.Event], None] | None = None,
                 instruments: Callable[[str], Instruments] | None = None, tracer: PublishTracer | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 supervisor_class: type[Supervisor[str, Engine]] = Supervisor) -> None:
        """`supervisor_class`: the reconcile step's class (the simulator swaps in a deliberate bug)."""
        super().__init__()
        self.name = name
        self._discover = discover
        self._rescan_interval = rescan_interval
        self._on_event = on_event
        self._instruments = instruments
        self._tracer = tracer
        self._clock = clock
        self.hubs = NotifyHubs(name=name)
        self.boards = StatusBoards(name=name)
        self._factory = engine_factory or self._live_engine
        self._lock = threading.Lock()
        self._supervisor: Supervisor[str, Engine] = supervisor_class(self._start_engine,
                                                                     describe=lambda label: f"Outbox {label}'s engine")
        self._wanted: dict[str, HarvestConfig] = {}
        self._next_scan = 0.0
        self._scan_failing = False
        self._manager: threading.Thread | None = None

    # -- the view (any thread) --------------------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    @property
    def outboxes(self) -> dict[str, HarvestConfig]:
        """The outboxes found by the last discovery, by label."""
        with self._lock:
            return dict(self._wanted)

    @property
    def engines(self) -> dict[str, Engine]:
        """The engines running (or stopping) now, by outbox label."""
        return self._supervisor.engines()

    @property
    def engine_health(self) -> dict[str, tuple[bool, int]]:
        """Every outbox wanted or still stopping, by label: whether its engine runs now, and how often it failed
        (an outbox whose engine fails in a loop has no engine most of the time: the metrics say so)."""
        return self._supervisor.health()

    @property
    def leading(self) -> list[str]:
        """The outboxes this process publishes now."""
        return sorted(label for label, engine in self.engines.items()
                      if engine.replica_state is ReplicaState.LEADER)

    @property
    def replica_state(self) -> ReplicaState:
        if self._state in (State.STOPPING, State.STOPPED):
            return ReplicaState.STOPPING if self._state is State.STOPPING else ReplicaState.STOPPED
        return ReplicaState.LEADER if self.leading else ReplicaState.STANDBY

    @property
    def published(self) -> int:
        return sum(engine.published for engine in self.engines.values())

    def discover(self) -> dict[str, HarvestConfig]:
        """The outboxes to harvest now, by label (what the supervisor asks every rescan_interval)."""
        return self._discover()

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Discover the outboxes (raises HarvestError if that fails) and start supervising them."""
        if not self.open():
            return  # stop() came during the first discovery (a SIGTERM at start): nothing was started
        with self._state_lock:  # a stop() from now on finds the manager, which ends at once and says so
            self._manager = threading.Thread(target=self._manage, name="outbox-outboxes", daemon=True)
            self._manager.start()

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


    # -- the supervisor thread --------------------------------------------------------------------

    def _manage(self) -> None:
        try:
            while not self._stopping.is_set():
                self.tick()
                self._stopping.wait(MANAGE_INTERVAL)
        except BaseException as error:  # a bug of ours, not an engine's failure: stop as a whole, saying why
            self._failure = error
            log.error("Harvester stopping after a failure: %s", first_line(error), exc_info=error)
        finally:
            self._state = State.STOPPING
            self._supervisor.stop_all()
            self.hubs.close()
            self.boards.close()
            self._state = State.STOPPED
            log.info("Stopped")
            self._stopped.set()

    def tick(self) -> None:
        """One look: discover again when due, then reconcile the engines with the outboxes found."""
        now = self._clock()
        if now >= self._next_scan:
            self._next_scan = now + self._rescan_interval
            self._rescan()
        self._reconcile(now)

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

    def _reconcile(self, now: float) -> None:
        """One step (supervisor.py): an engine for each outbox found; one whose outbox is gone or changed stops,
        and a fresh one starts once it settled."""
        with self._lock:
            wanted = dict(self._wanted)
        self._supervisor.reconcile(wanted, now, lambda label, engine: wanted.get(label) != engine.config,
                                   stopping=self._stopping.is_set)

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
