"""The Harvester: lifecycle (start, stop, wait), the engine loop, and what it reports.

    harvester = Harvester(config)
    harvester.start()      # raises HarvestError with a one-line reason; cleans up on failure
    ...
    harvester.stop()       # returns at once
    harvester.wait()       # blocks until stopped; re-raises a background failure

The engine thread runs leader election, marking and sending; the delivery thread purges and
resets. If either dies, the harvester stops as a whole and wait() says why.
"""

from __future__ import annotations

import enum
import logging
import os
import select
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import psycopg
from confluent_kafka import Consumer, Producer

from outbox.harvest import events
from outbox.harvest.config import HarvestConfig
from outbox.harvest.instruments import Instruments
from outbox.harvest.kafka import (
    ConsumerFactory,
    KafkaUnavailable,
    ProducerFactory,
    TopicEnsurer,
    ensure_topic,
    heartbeat_producer_config,
    leader_consumer_config,
    record_producer_config,
)
from outbox.harvest.mpr import AckWorker, Marked, Marker, Pipeline, Settled
from outbox.harvest.neli import Neli, Transition
from outbox.harvest.status import KEY_SAMPLE, StatusReporter, StatusSnapshot, status_table_exists
from outbox.harvest.store import Listener, PostgresStore, Record, Store, StoreError, connect, first_line

log = logging.getLogger(__name__)

StoreFactory = Callable[[str, str], Store]
ListenerFactory = Callable[[str, str], Any]
#: How long start() waits for Kafka to answer before reporting it unreachable.
KAFKA_START_TIMEOUT = 10.0


class State(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class HarvestError(Exception):
    """The harvester cannot start or has failed; str() is one line for the operator."""


class Harvester:
    """Harvests one outbox table; any number of replicas may run, exactly one leads."""

    def __init__(self, config: HarvestConfig, *, on_event: Callable[[events.Event], None] | None = None,
                 store_factory: StoreFactory = PostgresStore.open, producer_factory: ProducerFactory = Producer,
                 consumer_factory: ConsumerFactory = Consumer, topic_ensurer: TopicEnsurer = ensure_topic,
                 listener_factory: ListenerFactory | None = Listener, instruments: Instruments | None = None,
                 status_reports: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._instruments = instruments or Instruments()
        self._status_reports = status_reports
        self._on_event = on_event
        self._store_factory = store_factory
        self._producer_factory = producer_factory
        self._consumer_factory = consumer_factory
        self._topic_ensurer = topic_ensurer
        self._listener_factory = listener_factory
        self._clock = clock
        self._state = State.CREATED
        self._state_lock = threading.Lock()
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._failure: BaseException | None = None
        self._closing = False
        self._leader_id: uuid.UUID | None = None
        self._leader_since: float | None = None
        self._settled_lock = threading.Lock()
        self._settled: list[Settled] = []
        self._marked: list[Marked] = []
        self._mark_pending = False
        self._idle_until = 0.0
        self._next_queue_check = 0.0
        self._notified = False
        self._wake_read, self._wake_write = -1, -1
        self._store: Store | None = None
        self._producer: Any = None
        self._neli: Neli | None = None
        self._listener: Any = None
        self._pipeline: Pipeline | None = None
        self._acks: AckWorker | None = None
        self._marker: Marker | None = None
        self._status: StatusReporter | None = None
        self._role = "standby"
        self._role_since = datetime.now(UTC)
        self._started_at = datetime.now(UTC)
        #: Postgres's estimate of the harvested table's live rows, refreshed with the status row.
        self.backlog: int | None = None
        self._engine: threading.Thread | None = None
        self._published = 0
        self._failed = 0
        self._meter_started = clock()
        self._meter_published = 0
        self.last_meter: events.MeterStats | None = None

    # -- public view ------------------------------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    @property
    def is_leader(self) -> bool:
        """True while this replica holds a leader id (leads and is not fenced)."""
        return self._leader_id is not None

    @property
    def leader_id(self) -> uuid.UUID | None:
        return self._leader_id

    @property
    def is_fenced(self) -> bool:
        return self._neli is not None and self._neli.is_assigned and not self._neli.is_leader

    @property
    def in_flight_records(self) -> int:
        return len(self._pipeline.in_flight) if self._pipeline else 0

    @property
    def in_flight_keys(self) -> list[str]:
        # dict.copy() runs under the GIL in one step, so this is safe while the engine mutates it.
        return list(self._pipeline.in_flight.copy()) if self._pipeline else []

    @property
    def held_keys(self) -> dict[str, str]:
        return self._pipeline.held.copy() if self._pipeline else {}

    @property
    def published(self) -> int:
        return self._published

    @property
    def failed(self) -> int:
        return self._failed

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Connect to Postgres and Kafka and start harvesting in the background."""
        with self._state_lock:
            if self._state is not State.CREATED:
                raise HarvestError(f"cannot start a harvester that is {self._state.value}")
            problems = self.config.validate()
            if problems:
                raise HarvestError("invalid configuration: " + "; ".join(map(str, problems)))
            try:
                self._open()
            except BaseException as error:
                self._close_resources()
                if isinstance(error, StoreError | KafkaUnavailable):
                    raise HarvestError(str(error)) from None
                raise
            self._state = State.RUNNING
        self._engine = threading.Thread(target=self._run, name="outbox-engine", daemon=True)
        self._acks.start()
        self._marker.start()
        if self._status is not None:
            self._status.start()
        self._engine.start()
        log.info("Harvesting %s as %s (leader topic %s, group %s)", self.config.table, self.config.name,
                 self.config.leader_topic, self.config.leader_group)

    def _open(self) -> None:
        config = self.config
        self._store = self._store_factory(config.dsn, config.table)
        self._topic_ensurer(dict(config.base_kafka_config), config.leader_topic, KAFKA_START_TIMEOUT)
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._producer = self._producer_factory(record_producer_config(config))
        self._acks = AckWorker(self._producer, self._store, config.limits, self._on_settled, self._instruments)
        self._marker = Marker(self._store, self._on_marked, self._instruments)
        self._pipeline = Pipeline(config.limits, self._producer, self._acks.callback_for, self._clock,
                                  on_poison=self._note_poison)
        self._neli = Neli(config, self._consumer_factory(leader_consumer_config(config)),
                          self._producer_factory(heartbeat_producer_config(config)), self._on_transition, self._clock)
        if config.listen and self._listener_factory is not None:
            self._listener = self._listener_factory(config.dsn, config.channel)
        self._status = self._status_reporter()
        self._neli.start()

    def _status_reporter(self) -> StatusReporter | None:
        config = self.config
        if not (self._status_reports and config.status_table and config.limits.status_interval):
            return None
        try:
            with connect(config.dsn, "status") as conn:
                exists = status_table_exists(conn, config.status_table)
        except psycopg.Error as error:
            log.warning("Status rows off: %s", first_line(error))
            return None
        if not exists:
            log.info("Status rows off: table %s does not exist (manage.py migrate creates it)", config.status_table)
            return None
        return StatusReporter(config.dsn, config.status_table, name=config.name, harvested_table=config.table,
                              leader_topic=config.leader_topic, leader_group=config.leader_group,
                              started=self._started_at, interval=config.limits.status_interval,
                              prune_after=config.status_prune_after, snapshot=self.status,
                              on_backlog=self._set_backlog)

    def _set_backlog(self, rows: int) -> None:
        self.backlog = rows

    def status(self) -> StatusSnapshot:
        """What this replica would report now (safe from any thread)."""
        pipeline = self._pipeline
        keys = list(pipeline.in_flight.copy()) if pipeline else []
        held = pipeline.held.copy() if pipeline else {}
        meter = self.last_meter
        return StatusSnapshot(
            state="stopping" if self._state is State.STOPPING else self._role, leader_id=self._leader_id,
            since=self._role_since, in_flight=len(keys), in_flight_keys=keys[:KEY_SAMPLE],
            in_flight_key_count=len(keys), held_keys=[f"{k}: {v}" for k, v in list(held.items())[:KEY_SAMPLE]],
            throughput=meter.rate if meter else 0.0, published=self._published, failed=self._failed)

    def _set_role(self, role: str) -> None:
        if role != self._role:
            self._role, self._role_since = role, datetime.now(UTC)

    def _note_poison(self, record: Record, reason: str) -> None:
        try:
            self._store.hold(record.id, reason)
        except psycopg.Error as error:
            log.warning("Could not note the error on record %d: %s", record.id, first_line(error))

    def stop(self) -> None:
        """Ask the harvester to stop; returns at once. wait() blocks until it has."""
        with self._state_lock:
            if self._state is State.CREATED:
                self._state = State.STOPPED
                self._stopped.set()
                return
            if self._state is State.RUNNING:
                self._state = State.STOPPING
        self._stopping.set()
        self._wake()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stopped (True) or `timeout` passes (False); re-raises a background failure."""
        if not self._stopped.wait(timeout):
            return False
        if self._failure is not None:
            raise HarvestError(f"harvester failed: {first_line(self._failure)}") from self._failure
        return True

    # -- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                for worker in (self._acks, self._marker):
                    if worker.failure is not None:
                        raise worker.failure
                self._step()
            self._drain_on_stop()
        except BaseException as error:
            self._failure = error
            log.error("Harvester stopping after a failure: %s", first_line(error), exc_info=error)
        finally:
            with self._state_lock:
                self._state = State.STOPPING
            self._end_term()
            self._close_resources()
            log.info("Stopped (published %d, failed %d)", self._published, self._failed)
            with self._state_lock:
                self._state = State.STOPPED
            self._stopped.set()

    def _step(self) -> None:
        pipeline = self._pipeline
        limits = self.config.limits
        self._neli.pulse()
        self._absorb()
        self._meter()
        if self._leader_id is None:
            if self._neli.is_leader and not pipeline.in_flight:
                self._begin_term(refreshed=False)
            else:
                self._wait(limits.drain_interval)
                return
        if pipeline.force_remark:
            # A delivery or mark failed: nothing more may be sent under this leader id. Once the
            # records in flight are settled, a new id re-marks everything not yet purged (A9).
            pipeline.abandon()
            if pipeline.in_flight:
                self._wait(limits.drain_interval)
            else:
                self._begin_term(refreshed=True)
            return
        if self._clock() - self._neli.last_poll > limits.max_poll_interval:
            log.warning("Poll deadline exceeded (%.1fs without polling the leader topic); re-marking",
                        self._clock() - self._neli.last_poll)
            pipeline.force_remark = True
            return
        if pipeline.queued and self._clock() >= self._next_queue_check:
            # Scanning the queue costs O(queued): look a few times per timeout, not every step.
            self._next_queue_check = self._clock() + min(1.0, limits.queue_timeout / 4)
            if pipeline.oldest_queued_age() > limits.queue_timeout:
                log.warning("Queue timeout: a marked record waited more than %.1fs to be sent; re-marking",
                            limits.queue_timeout)
                pipeline.force_remark = True
                return
        pipeline.dispatch()
        wants_mark = pipeline.wants_records() and not self._mark_pending
        if wants_mark and (self._notified or self._clock() >= self._idle_until):
            self._notified = False
            self._mark_pending = True
            self._marker.request(self._leader_id, limits.mark_query_records)
        elif not pipeline.can_send():
            # Nothing to do until a delivery settles, a mark returns, or (idle) a NOTIFY arrives.
            idle = wants_mark and self._listener is not None
            self._wait(max(0.0, self._idle_until - self._clock()) if wants_mark else limits.drain_interval,
                       idle=idle)

    def _on_marked(self, marked: Marked) -> None:
        """Called on the marker thread when a mark query returns."""
        with self._settled_lock:
            self._marked.append(marked)
        self._wake()

    def _begin_term(self, *, refreshed: bool) -> None:
        self._pipeline.new_term()
        self._leader_id = uuid.uuid4()  # fresh at every acquisition and refresh, never reused
        self._set_role("leader")
        if refreshed:
            log.warning("Refreshed leader id: %s", self._leader_id)
            self._emit(events.LeaderRefreshed(self._leader_id))
        else:
            self._leader_since = time.time()
            log.info("Leading with leader id %s", self._leader_id)
            self._emit(events.LeaderAcquired(self._leader_id))

    def _end_term(self) -> None:
        self._leader_id = None
        self._leader_since = None
        if self._pipeline is not None:
            self._pipeline.abandon()

    def _on_transition(self, transition: Transition) -> None:
        """Leader election callbacks (inside the consumer's poll, on the engine thread)."""
        if transition is Transition.ACQUIRED:
            return  # a term begins in _step once nothing from an earlier term is in flight
        was_leading = self._leader_id is not None
        self._end_term()
        if transition is Transition.FENCED:
            self._set_role("fenced")
            self._emit(events.LeaderFenced())
            return
        self._set_role("standby")
        if transition is Transition.REVOKED and not self._closing:
            # Kafka waits for this callback before assigning partition 0 elsewhere: settle what
            # is in flight first, so the next leader does not resend it.
            self._drain(self._producer_deadline())
        if was_leading or transition is Transition.LOST:
            self._emit(events.LeaderRevoked())

    def _drain_on_stop(self) -> None:
        """Graceful stop: send nothing more, settle what is in flight (bounded), keep the group alive meanwhile."""
        self._end_term()
        self._drain(self._producer_deadline(), pulse=True)
        if self._pipeline.in_flight:
            log.warning("Stopping with %d record(s) unsettled; the next leader re-marks them",
                        len(self._pipeline.in_flight))

    def _drain(self, timeout: float, *, pulse: bool = False) -> None:
        deadline = self._clock() + timeout
        while self._pipeline.in_flight and self._clock() < deadline and self._acks.failure is None:
            if pulse:
                self._neli.pulse()
            self._absorb()
            self._wait(min(0.05, max(0.0, deadline - self._clock())), pulse=False)

    def _producer_deadline(self) -> float:
        configured = record_producer_config(self.config).get("delivery.timeout.ms", 30_000)
        return float(configured) / 1000 + 2 * self.config.limits.io_error_backoff + 1.0

    # -- between threads -------------------------------------------------------------------------

    def _on_settled(self, settled: list[Settled]) -> None:
        """Called on the delivery thread once purges/resets have committed."""
        with self._settled_lock:
            self._settled.extend(settled)
        self._wake()

    def _absorb(self) -> None:
        """Take in what the delivery and marker threads handed over."""
        with self._settled_lock:
            settled, self._settled = self._settled, []
            marked, self._marked = self._marked, []
        if settled:
            failed = sum(1 for item in settled if item.error is not None)
            self._published += len(settled) - failed
            self._failed += failed
            self._pipeline.settle(settled)
        for result in marked:
            self._mark_pending = False
            if result.error is not None:
                # The UPDATE may have committed although we saw an error: re-mark, never retry as is.
                log.warning("Mark query failed, re-marking after %.1fs: %s", self.config.limits.io_error_backoff,
                            first_line(result.error))
                self._idle_until = self._clock() + self.config.limits.io_error_backoff
                if result.leader_id == self._leader_id:
                    self._pipeline.force_remark = True
            elif result.leader_id != self._leader_id or self._pipeline.force_remark:
                continue  # marked under an id no longer current: the next term re-marks these rows
            elif result.records:
                self._pipeline.enqueue(result.records)
            else:
                self._idle_until = self._clock() + self.config.limits.mark_backoff

    def _wake(self) -> None:
        if self._wake_write >= 0:
            try:
                os.write(self._wake_write, b"\0")
            except (BlockingIOError, OSError):
                pass  # the pipe is full (a wake is pending) or closed (stopping)

    def _wait(self, timeout: float, *, idle: bool = False, pulse: bool = True) -> None:
        """Sleep until a delivery settles, a NOTIFY arrives (when idle), or `timeout` passes.

        Never past the next leader-topic poll, so Kafka keeps seeing this replica alive.
        """
        if pulse:
            timeout = min(timeout, self._neli.seconds_to_next_poll())
        readers = [self._wake_read]
        listen_fd = self._listener.fileno() if (idle and self._listener is not None) else None
        if listen_fd is not None:
            readers.append(listen_fd)
        ready, _, _ = select.select(readers, [], [], max(0.0, timeout))
        if self._wake_read in ready:
            try:
                while os.read(self._wake_read, 4096):
                    pass
            except BlockingIOError:
                pass
        if listen_fd is not None and listen_fd in ready and self._listener.drain():
            self._notified = True

    def _meter(self) -> None:
        now = self._clock()
        interval = now - self._meter_started
        if interval < self.config.limits.min_metrics_interval:
            return
        published = self._published - self._meter_published
        stats = events.MeterStats(interval=interval, published=published, rate=published / interval if interval else 0,
                                  total_published=self._published, total_failed=self._failed,
                                  in_flight=len(self._pipeline.in_flight))
        self._meter_started, self._meter_published = now, self._published
        self.last_meter = stats
        if published or self._leader_id is not None:
            log.info("Throughput %.0f records/s (%d in %.1fs; %d published, %d failed, %d in flight)", stats.rate,
                     published, interval, stats.total_published, stats.total_failed, stats.in_flight)
        self._emit(events.MeterRead(stats))

    def _emit(self, event: events.Event) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(event)
        except Exception:
            log.exception("Event handler failed for %s", type(event).__name__)

    def _close_resources(self) -> None:
        self._closing = True  # a revoke during close must not wait for deliveries
        if self._status is not None and self._status.is_alive():
            self._status.stop()
            self._status.join(timeout=10)
        if self._marker is not None and self._marker.is_alive():
            self._marker.stop()
            self._marker.join(timeout=10)
        if self._acks is not None and self._acks.is_alive():
            self._acks.stop()
            self._acks.join(timeout=10)
        if self._neli is not None:
            self._neli.close()
        if self._producer is not None:
            remaining = self._producer.flush(2.0)
            if remaining:
                log.warning("%d message(s) still queued in the producer at close", remaining)
        if self._listener is not None:
            self._listener.close()
        if self._store is not None:
            self._store.close()
        for fd in (self._wake_read, self._wake_write):
            if fd >= 0:
                os.close(fd)
        self._wake_read = self._wake_write = -1
