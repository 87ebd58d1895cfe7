"""The Harvester: the driver (driver.py) over real I/O (runtime.py), with a lifecycle (start, stop, wait).

    harvester = Harvester(config)
    harvester.start()      # raises HarvestError with a one-line reason; cleans up on failure
    ...
    harvester.stop()       # returns at once
    harvester.wait()       # blocks until stopped; re-raises a background failure

This file runs the driver's turns on the engine thread and keeps the view other threads read (state, snapshot,
meter), which the status writer reports (status_board.py). If any thread dies, the harvester stops and wait() says why.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from operator import methodcaller
from typing import Any

from confluent_kafka import KafkaException

from outbox.harvest import dbtime, events
from outbox.harvest.config import HarvestConfig
from outbox.harvest.connector import Connector, LiveConnector
from outbox.harvest.contract import HeldRecord, ReplicaState
from outbox.harvest.core import Core
from outbox.harvest.driver import Driver
from outbox.harvest.instruments import Instruments
from outbox.harvest.runtime import ThreadedIO
from outbox.harvest.status import StatusSnapshot, snapshot_of
from outbox.harvest.status_board import BoardReporter
from outbox.harvest.store import StoreError
from outbox.harvest.tracing import PublishTracer
from outbox.kafka.clients import KafkaUnavailable
from outbox.kafka.redaction import remember_secrets, scrub
from outbox.reasons import first_line, kafka_reason

log = logging.getLogger(__name__)

SNAPSHOT_INTERVAL = 0.05


class State(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class HarvestError(Exception):
    """The harvester cannot start or has failed; str() is one line for the operator, with any secret
    value a client's error quoted masked."""

    def __init__(self, message: str) -> None:
        super().__init__(scrub(message))


def check_config(config: HarvestConfig) -> None:
    if problems := config.validate():
        raise HarvestError("invalid configuration: " + "; ".join(map(str, problems)))


def start_failure(error: BaseException) -> HarvestError | None:
    """The one line an engine that cannot start says of `error` (None: a surprise, raised as it is)."""
    if isinstance(error, StoreError | KafkaUnavailable):
        return HarvestError(str(error))
    if isinstance(error, KafkaException):
        return HarvestError(f"cannot create a Kafka client: {kafka_reason(error)}")
    return None


class Lifecycle:
    """start/stop/wait's state (Harvester, and supervisor.EngineSet): stop() asks and returns at once, wait() blocks
    until the background thread set `_stopped` and re-raises what it left in `_failure`."""

    def __init__(self) -> None:
        self._state = State.CREATED
        self._state_lock = threading.Lock()
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._failure: BaseException | None = None

    @property
    def state(self) -> State:
        return self._state

    def stop(self) -> None:
        """Ask to stop (what is in flight settles first); returns at once. wait() blocks until stopped."""
        with self._state_lock:
            if self._state is State.CREATED:
                self._state = State.STOPPED
                self._stopped.set()
                return
            if self._state is State.RUNNING:
                self._state = State.STOPPING
        self._stopping.set()
        self._stop_requested()

    def _stop_requested(self) -> None:
        """After stop() set `_stopping`: wake the background thread if it waits on something else."""

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stopped (True) or `timeout` passes (False); re-raises a background failure."""
        if not self._stopped.wait(timeout):
            return False
        if self._failure is not None:
            raise HarvestError(f"harvester failed: {first_line(self._failure)}") from self._failure
        return True


class Harvester(Lifecycle):
    """Harvests one outbox table; any number of replicas may run, exactly one leads."""

    def __init__(self, config: HarvestConfig, *, connector: Connector | None = None,
                 on_event: Callable[[events.Event], None] | None = None, instruments: Instruments | None = None,
                 clock: Callable[[], float] = time.monotonic, tracer: PublishTracer | None = None) -> None:
        self.config = config
        # Whatever logs or raises from here on masks this configuration's secrets (redaction.py).
        remember_secrets(config.dsn, config.base_kafka_config, config.producer_kafka_config)
        self._connector = connector if connector is not None else LiveConnector(config)
        self._on_event = on_event
        self._instruments = instruments or Instruments()
        self._clock = clock
        super().__init__()
        self._core = self._new_core()
        self._io = self._new_io()
        self._driver = self._new_driver(tracer)
        self._status: BoardReporter | None = None
        self._engine: threading.Thread | None = None
        self._since = datetime.now(UTC)
        self._snapshot = self._core.snapshot()
        self._snapshot_at = 0.0
        self._meter_started = clock()
        self._meter_published = 0
        self.last_meter: events.MeterStats | None = None
        #: Postgres's estimate of the harvested table's live rows, refreshed with the status row.
        self.backlog: int | None = None

    @property
    def replica_state(self) -> ReplicaState:
        return self._snapshot.state

    @property
    def is_leader(self) -> bool:
        """True while this replica leads with a leader id (assigned, not fenced, fence held)."""
        return self._snapshot.leader_id is not None

    @property
    def leader_id(self) -> Any:
        return self._snapshot.leader_id

    @property
    def is_fenced(self) -> bool:
        return self._snapshot.state is ReplicaState.FENCED

    @property
    def in_flight_records(self) -> int:
        return self._snapshot.in_flight

    @property
    def in_flight_keys(self) -> list[str]:
        return list(self._snapshot.in_flight_keys)

    @property
    def held(self) -> list[HeldRecord]:
        """Held (poison) records: they fail on their own, and their keys wait."""
        return list(self._snapshot.held)

    @property
    def held_keys(self) -> dict[str, str]:
        return {held.key: held.reason for held in self._snapshot.held}

    @property
    def topic_limits(self) -> dict[str, int]:
        """Each topic's max.message.bytes as last read from Kafka (topics.UNLIMITED: could not be read)."""
        limits = self._io.topic_limits
        return limits.snapshot() if limits is not None else {}

    @property
    def published(self) -> int:
        return self._snapshot.published

    @property
    def failed(self) -> int:
        return self._snapshot.failed

    def status(self) -> StatusSnapshot:
        """What this replica would report now."""
        meter = self.last_meter
        return snapshot_of(self._snapshot, stopping=self._state is State.STOPPING, since=self._since,
                           throughput=meter.rate if meter else 0.0, round_trips=self.round_trips)

    @property
    def round_trips(self) -> dbtime.Totals:
        """This replica's database round trips since it started, by kind (dbtime.py)."""
        return self._driver.round_trips.totals()

    @property
    def database_statements(self) -> dbtime.Totals | None:
        """The server's time per statement kind on this table, as this replica's status reporter last read it
        (pg_stat_statements; None unless it leads and the database has the view)."""
        return self._status.statements if self._status is not None else None

    @classmethod
    def sending_events_to(cls, sink: Callable[[Harvester, events.Event], None] | None, config: HarvestConfig,
                          **kwargs: Any) -> Harvester:
        """A Harvester whose events reach `sink` with the harvester that sent them (Django's signals want the
        sender, which does not exist before it is built)."""
        holder: list[Harvester] = []
        harvester = cls(config, on_event=None if sink is None else lambda event: sink(holder[0], event), **kwargs)
        holder.append(harvester)
        return harvester

    def start(self) -> None:
        """Connect to Postgres and Kafka and start harvesting in the background."""
        self.open()
        self._engine = threading.Thread(target=self._run, name="outbox-engine", daemon=True)
        self._io.start()
        if self._status is not None:
            self._status.start()
        self._engine.start()
        log.info("Harvesting %s as %s (leader topic %s, group %s)", self.config.table, self.config.name,
                 self.config.leader_topic, self.config.leader_group)

    def open(self) -> None:
        """start() but its threads: check the configuration, connect, RUNNING (the simulator then runs step())."""
        with self._state_lock:
            if self._state is not State.CREATED:
                raise HarvestError(f"cannot start a harvester that is {self._state.value}")
            check_config(self.config)
            try:
                self._io.open(self._driver)
                self._status = self._connector.status_reporter(self.status, lambda rows: setattr(self, "backlog", rows))
            except BaseException as error:
                self._close_resources()
                if (failure := start_failure(error)) is not None:
                    raise failure from None
                raise
            self._state = State.RUNNING

    def _stop_requested(self) -> None:
        self._io.wake()

    def _run(self) -> None:
        while (deadline := self.step()) is not None:
            try:
                self._io.wait(deadline)
            except BaseException as error:
                self._end(error)
                return

    def step(self) -> float | None:
        """One turn of the engine thread (the simulator's on its clock). Returns the clock time to sleep until (a wake
        or a NOTIFY ends it sooner), or None once the engine ended and closed what it opened."""
        core = self._core
        try:
            if (failure := self._io.failure()) is not None:
                raise failure
            if self._stopping.is_set() and not core.stopping:
                # Graceful: send nothing more, let what is in flight settle (bounded), stay in the group meanwhile.
                self._driver.post(methodcaller("stop"))
            deadline = self._driver.turn()
            self._refresh(self._clock())
            if not core.finished:
                return deadline
        except BaseException as error:
            self._end(error)
            return None
        self._end(None)
        return None

    def _end(self, failure: BaseException | None) -> None:
        """The engine's end: what it opened closes, then STOPPED (wait() re-raises `failure`)."""
        if failure is not None:
            self._failure = failure
            log.error("Harvester stopping after a failure: %s", first_line(failure), exc_info=failure)
        with self._state_lock:
            self._state = State.STOPPING
        self._close_resources()
        log.info("Stopped (published %d, failed %d)", self._core.published, self._core.failed)
        with self._state_lock:
            self._state = State.STOPPED
        self._stopped.set()

    def _new_core(self) -> Core:
        config = self.config
        sharded = config.shards > 1
        return Core(config.limits, park_after=config.park_after, now=self._clock(), handoff_by_fence=sharded,
                    **({"leads": f"shard {config.shard} of {config.shards}"} if sharded else {}))

    def _new_io(self) -> ThreadedIO:
        return ThreadedIO(self.config, self._connector, self._clock, self._announce)

    def _new_driver(self, tracer: PublishTracer | None) -> Driver:
        return Driver(self._core, self._io, instruments=self._instruments, parked_by=f"harvester {self.config.name}",
                      tracer=tracer)

    def _announce(self, event: events.Event) -> None:
        self._take_snapshot()  # what other threads read follows the event at once
        self._emit(event)

    def _refresh(self, now: float) -> None:
        """Refresh the snapshot other threads read (at most every SNAPSHOT_INTERVAL), and meter."""
        if now - self._snapshot_at >= SNAPSHOT_INTERVAL:
            self._take_snapshot()
        interval = now - self._meter_started
        if interval < self.config.limits.min_metrics_interval:
            return
        core = self._core
        published = core.published - self._meter_published
        stats = events.MeterStats(interval=interval, published=published, rate=published / interval if interval else 0,
                                  total_published=core.published, total_failed=core.failed,
                                  in_flight=core.in_flight)
        self._meter_started, self._meter_published = now, core.published
        self.last_meter = stats
        if published:  # an idle replica logs nothing
            log.info("%s", stats)
        self._emit(events.MeterRead(stats))

    def _take_snapshot(self) -> None:
        self._snapshot_at = self._clock()
        previous = self._snapshot.state
        self._snapshot = self._core.snapshot()
        if self._snapshot.state is not previous:
            self._since = datetime.now(UTC)

    def _emit(self, event: events.Event) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(event)
        except Exception:
            log.exception("Event handler failed for %s", type(event).__name__)

    def _close_resources(self) -> None:
        if self._status is not None:
            self._status.close()
        self._io.close()
