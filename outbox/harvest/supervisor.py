"""One reconcile step for a process's set of engines (an EngineSet: a sharded replica's engine per shard, shards.py;
one per outbox, outboxes.py; the simulators, tests/sim, run the same tick() on their clocks): start what should run
and does not, stop what should not, forget what stopped.

An engine is stopped, never dropped: its slot is free for a new engine only once what it had in flight settled
(a shard's hand-off waits on that). A failed engine is started again after RESTART_BACKOFF, doubled at each failure
in a row up to MAX_BACKOFF (a good run of MAX_BACKOFF starts the count again): one broken engine never stops the
others.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from outbox.harvest.config import HarvestConfig
from outbox.harvest.contract import ReplicaState
from outbox.harvest.harvester import HarvestError, Lifecycle, State
from outbox.harvest.notify_hub import NotifyHubs
from outbox.harvest.status_board import StatusBoards
from outbox.kafka.clients import KafkaUnavailable
from outbox.reasons import first_line

log = logging.getLogger("outbox.harvest.supervisor")

RESTART_BACKOFF = 2.0
MAX_BACKOFF = 60.0
#: What a set that stops, or stopped, reports of itself (running: whether one of its engines leads).
ENDING = {State.STOPPING: ReplicaState.STOPPING, State.STOPPED: ReplicaState.STOPPED}


class EngineLike(Protocol):
    """What the supervisor needs of an engine (a Harvester, a ShardedHarvester)."""

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


K = TypeVar("K")
E = TypeVar("E", bound=EngineLike)
R = TypeVar("R", bound=EngineLike)


@dataclass
class Slot(Generic[E]):
    """One key's engine, if any, and when to start it again after a failure."""

    engine: E | None = None
    started_at: float = 0.0
    failures: int = 0
    retry_at: float = 0.0
    #: Every failure to start or run since the process started (`failures` is reset after a good run).
    failed_total: int = 0


class Supervisor(Generic[K, E]):
    """The engines of one process by key (a shard number, an outbox label), and the step that reconciles them."""

    def __init__(self, start: Callable[[K], E], *, describe: Callable[[K], str]) -> None:
        """`start(key)`: a new engine, started (or HarvestError); `describe(key)`: its name in the log."""
        self._start_engine, self._describe = start, describe
        self._lock = threading.Lock()
        self._slots: dict[K, Slot[E]] = {}

    def engines(self) -> dict[K, E]:
        with self._lock:
            return {key: slot.engine for key, slot in self._slots.items() if slot.engine is not None}

    def health(self) -> dict[K, tuple[bool, int]]:
        with self._lock:
            return {key: (slot.engine is not None and slot.engine.state is State.RUNNING, slot.failed_total)
                    for key, slot in self._slots.items()}

    def reconcile(self, wanted: Collection[K], now: float, retire: Callable[[K, E], bool],
                  stopping: Callable[[], bool] = lambda: False) -> None:
        """Forget engines that stopped (a failure delays the next start), stop those `retire` says must go (they
        settle first), and start one for each key wanted that has none and whose backoff passed."""
        for key, slot in list(self._slots.items()):
            engine = slot.engine
            if engine is not None and engine.state is State.STOPPED:
                self._reap(key, slot, engine, now)
            elif engine is not None and engine.state is State.RUNNING and retire(key, engine):
                engine.stop()
            if slot.engine is None and key not in wanted:
                with self._lock:
                    del self._slots[key]
        for key in sorted(wanted):  # type: ignore[type-var]  # shard numbers and labels both sort
            if stopping():
                return  # starting fifty engines takes a while: a stop need not wait for the rest
            with self._lock:
                slot = self._slots.setdefault(key, Slot())
            if slot.engine is None and now >= slot.retry_at:
                self._start(key, slot, now)

    def settle_all(self) -> bool:
        """One step of the end: ask every engine to stop, forget those that stopped (saying a failure once); True
        once none is left."""
        for key, slot in list(self._slots.items()):
            engine = slot.engine
            if engine is not None and engine.state is State.STOPPED:
                try:
                    engine.wait(0)
                except HarvestError as error:
                    log.warning("%s: %s", self._describe(key), error)
                engine = None
            elif engine is not None:
                engine.stop()
            if engine is None:
                with self._lock:
                    del self._slots[key]
        return not self._slots

    def stop_all(self) -> None:
        """Stop every engine and wait for each (the manager thread's end)."""
        while not self.settle_all():
            for engine in self.engines().values():
                with contextlib.suppress(HarvestError):  # settle_all() says it
                    engine.wait()

    def _reap(self, key: K, slot: Slot[E], engine: E, now: float) -> None:
        try:
            engine.wait(0)
            failure = None
        except HarvestError as error:
            failure = error
        with self._lock:
            slot.engine = None
        if failure is not None:
            if now - slot.started_at >= MAX_BACKOFF:
                slot.failures = 0  # it ran a good while: a new failure, not one of a loop
            self._failed(key, slot, now, f"failed: {failure}")

    def _start(self, key: K, slot: Slot[E], now: float) -> None:
        try:
            engine = self._start_engine(key)
        except HarvestError as error:
            self._failed(key, slot, now, f"cannot start: {error}")
            return
        except Exception as error:  # one engine's surprise must not stop the others: said in full, tried again
            log.exception("%s cannot start", self._describe(key))
            self._failed(key, slot, now, f"cannot start: {first_line(error)}")
            return
        with self._lock:
            slot.engine = engine
        slot.started_at = now

    def _failed(self, key: K, slot: Slot[E], now: float, why: str) -> None:
        backoff = min(MAX_BACKOFF, RESTART_BACKOFF * 2 ** slot.failures)
        slot.failures += 1
        slot.failed_total += 1
        slot.retry_at = now + backoff
        log.error("%s %s (started again in %gs)", self._describe(key), why, backoff)


class EngineSet(Lifecycle, Generic[K, R]):
    """A process's engines under one Supervisor, stepped by one manager thread: `wanted` and `retires` are its
    kind's; open() prepares without a thread, tick() is one step (start() runs it every `manage_interval`). Its
    engines share the process's LISTEN hubs and status boards (its own, unless given those of a set it is in)."""

    manage_interval = 0.1
    kind = "Harvester"
    thread_name = "outbox-engines"

    def __init__(self, start_engine: Callable[[K], R], *, describe: Callable[[K], str], name: str = "",
                 hubs: NotifyHubs | None = None, boards: StatusBoards | None = None,
                 supervisor_class: type[Supervisor[K, R]] = Supervisor,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`supervisor_class`: the reconcile step's class (the simulator swaps in a deliberate bug)."""
        super().__init__()
        self.name = name
        self._supervisor: Supervisor[K, R] = supervisor_class(start_engine, describe=describe)
        self._own_services = hubs is None and boards is None
        self.hubs = hubs if hubs is not None else NotifyHubs(name=name)
        self.boards = boards if boards is not None else StatusBoards(name=name)
        self._clock = clock
        self._manager: threading.Thread | None = None

    def open(self) -> bool:
        """Prepare and go RUNNING (or HarvestError); False if stop() came meanwhile."""
        raise NotImplementedError

    def wanted(self, now: float) -> Collection[K]:
        """The keys that should have an engine now."""
        raise NotImplementedError

    def retires(self, key: K, engine: R) -> bool:
        """Whether a running engine must stop (it settles first)."""
        raise NotImplementedError

    def _closed(self) -> None:
        """After every engine stopped: end what the kind holds."""

    def _leads(self, engine: R) -> bool:
        return engine.replica_state is ReplicaState.LEADER

    @property
    def engines(self) -> dict[K, R]:
        """The engines running or settling now, by key."""
        return self._supervisor.engines()

    @property
    def engine_health(self) -> dict[K, tuple[bool, int]]:
        """Every key wanted or settling: whether its engine runs now, and how often it failed (the metrics')."""
        return self._supervisor.health()

    @property
    def leading(self) -> list[K]:
        """The keys whose engine publishes now."""
        return sorted(key for key, engine in self.engines.items() if self._leads(engine))  # type: ignore[type-var]

    @property
    def replica_state(self) -> ReplicaState:
        return ENDING.get(self._state) or (ReplicaState.LEADER if self.leading else ReplicaState.STANDBY)

    @property
    def published(self) -> int:
        return sum(engine.published for engine in self.engines.values())

    def start(self) -> None:
        """open() (HarvestError with a one-line reason), then tick() on the manager thread."""
        if not self.open():
            return  # stop() came meanwhile (a SIGTERM at start): nothing was started
        with self._state_lock:  # a stop() from now on finds the manager, which ends at once and says so
            self._manager = threading.Thread(target=self._manage, name=self.thread_name, daemon=True)
            self._manager.start()

    def tick(self) -> None:
        now = self._clock()
        self._supervisor.reconcile(self.wanted(now), now, self.retires, stopping=self._stopping.is_set)

    def _manage(self) -> None:
        try:
            while not self._stopping.is_set():
                self.tick()
                self._stopping.wait(self.manage_interval)
        except BaseException as error:  # not an engine's failure: stop as a whole, saying why (a bug's traceback)
            self._failure = error
            log.error("%s stopping after a failure: %s", self.kind, first_line(error),
                      exc_info=None if isinstance(error, (HarvestError, KafkaUnavailable)) else error)
        finally:
            self._state = State.STOPPING  # the view says so while the engines settle
            self._supervisor.stop_all()
            self.end_step()  # every engine stopped: it ends at once

    def end_step(self) -> bool:
        """One step of the end (the manager's, or a simulator's): every engine asked to stop; once all stopped, what
        the set holds ends and it is STOPPED (True)."""
        if self._state is State.STOPPED:
            return True
        self._state = State.STOPPING
        if not self._supervisor.settle_all():
            return False
        self._closed()
        if self._own_services:
            self.hubs.close()
            self.boards.close()
        self._state = State.STOPPED
        log.info("Stopped")
        self._stopped.set()
        return True
