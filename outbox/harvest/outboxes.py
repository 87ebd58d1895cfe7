"""Many outboxes in one process: an engine per outbox, under one supervisor (supervisor.py).

    harvester = ManyHarvester(discover)       # discover() -> {label: HarvestConfig}, one per outbox
    harvester.start(); ...; harvester.stop(); harvester.wait()

Each outbox (a table in some database, or the outbox table of every tenant schema, tenants.py) is harvested as
by a process of its own (its leader topic and group, or shards, fence, producer and status row, named
`replica-a/acme`), on the process's shared services (process_services.py). The manager asks `discover` again every
`rescan_interval`: an outbox that appears gets an engine, one that disappears or changes has its engine stopped
once it settled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from outbox.harvest import events
from outbox.harvest.config import HarvestConfig
from outbox.harvest.connector import LiveConnector
from outbox.harvest.harvester import Harvester, HarvestError, State
from outbox.harvest.instruments import Instruments
from outbox.harvest.shards import ShardedHarvester
from outbox.harvest.status import StatusSnapshot
from outbox.harvest.status_board import BoardReporter
from outbox.harvest.store import PostgresStore
from outbox.harvest.supervisor import EngineLike, EngineSet, Supervisor
from outbox.harvest.tracing import PublishTracer
from outbox.logs import SaidOnce
from outbox.reasons import first_line

log = logging.getLogger("outbox.harvest.outboxes")

#: Seconds between two steps of the manager.
MANAGE_INTERVAL = 0.1
#: Seconds between two discoveries (new tenant schemas, dropped ones), by default.
RESCAN_INTERVAL = 30.0


class RestingStore(PostgresStore):
    """A store whose fence session is closed while it holds no fence: fifty outboxes' standbys need no session
    (take_fence opens one when the engine comes to lead). Both calls run where the fence session's jobs run."""

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
    """The live connector of one outbox's engine among many: the process's hubs and boards, no standby's lines, and
    a fence session only while it leads."""

    store_class = RestingStore

    def status_reporter(self, snapshot: Callable[[], StatusSnapshot], on_backlog: Callable[[int], None], *,
                        sharded_replica: bool = False) -> BoardReporter | None:
        return self.boards.reporter(self.config, snapshot, on_backlog, one_of_many=True)


class ManyHarvester(EngineSet[str, EngineLike]):
    """Harvests every outbox `discover` names, an engine each, in this process (module docstring)."""

    manage_interval = MANAGE_INTERVAL
    thread_name = "outbox-outboxes"

    def __init__(self, discover: Callable[[], dict[str, HarvestConfig]], *, name: str = "",
                 rescan_interval: float = RESCAN_INTERVAL,
                 engine_factory: Callable[[str, HarvestConfig], EngineLike] | None = None,
                 on_event: Callable[[Any, events.Event], None] | None = None,
                 instruments: Callable[[str], Instruments] | None = None, tracer: PublishTracer | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 supervisor_class: type[Supervisor[str, EngineLike]] = Supervisor) -> None:
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
        self._scan_outage = SaidOnce(log, "Cannot look for outboxes (the ones found before go on; looked again every "
                                   "%gs): %s", "Looking for outboxes works again")

    @property
    def outboxes(self) -> dict[str, HarvestConfig]:
        """The outboxes found by the last discovery, by label."""
        with self._lock:
            return dict(self._wanted)

    def discover(self) -> dict[str, HarvestConfig]:
        """The outboxes to harvest now, by label."""
        return self._discover()

    def open(self) -> bool:
        """The first discovery (HarvestError if it fails); False if stop() came meanwhile."""
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

    def wanted(self, now: float) -> dict[str, HarvestConfig]:
        """The outboxes found (discovered again when due)."""
        if now >= self._next_scan:
            self._next_scan = now + self._rescan_interval
            self._rescan()
        return self.outboxes

    def retires(self, label: str, engine: EngineLike) -> bool:
        with self._lock:
            return self._wanted.get(label) != engine.config

    def _rescan(self) -> None:
        try:
            found = self._discover()
        except Exception as error:
            self._scan_outage.failed(self._rescan_interval, first_line(error))
            return
        self._scan_outage.ended()
        with self._lock:
            before, self._wanted = self._wanted, dict(found)
        for label in sorted(set(found) - set(before)):
            log.info("Outbox %s found (%s)", label, found[label].table)
        for label in sorted(set(before) - set(found)):
            log.info("Outbox %s gone: its engine stops", label)

    def _start_engine(self, label: str) -> EngineLike:
        with self._lock:
            config = self._wanted[label]
        engine = self._factory(label, config)
        engine.start()
        return engine

    def _live_engine(self, label: str, config: HarvestConfig) -> EngineLike:
        """A Harvester, or a ShardedHarvester, on the process's hubs and boards."""
        if config.shards > 1:
            return ShardedHarvester(config, on_event=self._on_event, tracer=self._tracer,
                                    instruments=(lambda _shard: self._instruments(label))
                                    if self._instruments is not None else None, hubs=self.hubs,
                                    boards=self.boards)
        return Harvester.sending_events_to(
            self._on_event, config, connector=ManyConnector(config, self.hubs, self.boards), tracer=self._tracer,
            instruments=self._instruments(label) if self._instruments is not None else None)
