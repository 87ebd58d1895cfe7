"""The Harvester: the shell around the core, with its lifecycle (start, stop, wait) and its threads.

    harvester = Harvester(config)
    harvester.start()      # raises HarvestError with a one-line reason; cleans up on failure
    ...
    harvester.stop()       # returns at once
    harvester.wait()       # blocks until stopped; re-raises a background failure

The core (core.py) decides; this file only carries its commands out and reports back. Threads:
- engine: owns the core, polls the leader topic, produces records, waits for work;
- delivery: polls the record producer, whose delivery reports it hands to the engine;
- fence worker and purge worker: run the SQL on the store's two sessions;
- status: writes this replica's status row.
If any of them dies, the harvester stops as a whole and wait() says why.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import psycopg
from confluent_kafka import KafkaError, KafkaException

from outbox.harvest import commands as cmd
from outbox.harvest import contract, events
from outbox.harvest.commands import DeliveryError
from outbox.harvest.config import HarvestConfig
from outbox.harvest.connector import Connector, ListenerLike, LiveConnector, Store
from outbox.harvest.contract import HeldRecord, Record, ReplicaState, iso_utc
from outbox.harvest.core import Core
from outbox.harvest.instruments import Instruments
from outbox.harvest.kafka import KafkaUnavailable, ProducerLike, kafka_reason
from outbox.harvest.neli import LeaderElection
from outbox.harvest.status import StatusReporter, StatusSnapshot
from outbox.harvest.store import StoreError, first_line

log = logging.getLogger(__name__)

#: Delivery errors that will fail the same way on every retry: the record is a poison suspect.
PERMANENT_ERRORS = frozenset({
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.INVALID_RECORD,
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.TOPIC_EXCEPTION,
    KafkaError.INVALID_REQUIRED_ACKS,
    KafkaError._INVALID_ARG,
})
#: How often the cached status snapshot is refreshed (at most).
SNAPSHOT_INTERVAL = 0.05


class State(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class HarvestError(Exception):
    """The harvester cannot start or has failed; str() is one line for the operator."""


def delivery_error(error: KafkaError) -> DeliveryError:
    """Kafka's error, as the core sees it."""
    permanent = error.code() in PERMANENT_ERRORS and not error.retriable()
    return DeliveryError(error.name(), error.str(), permanent=permanent, fatal=error.fatal())


class Worker(threading.Thread):
    """Runs jobs one at a time, in order, on a thread (and so a database session) of its own."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._jobs: deque[Callable[[], None] | None] = deque()
        self._signal = threading.Condition()
        self.failure: BaseException | None = None

    def submit(self, job: Callable[[], None]) -> None:
        with self._signal:
            self._jobs.append(job)
            self._signal.notify()

    def stop(self) -> None:
        """Finish the jobs already submitted, then end."""
        self.submit(None)  # type: ignore[arg-type]

    def run(self) -> None:
        try:
            while True:
                with self._signal:
                    while not self._jobs:
                        self._signal.wait()
                    job = self._jobs.popleft()
                if job is None:
                    return
                job()
        except BaseException as error:  # the harvester notices and stops as a whole
            self.failure = error
            log.exception("%s thread failed", self.name)


class DeliveryPoller(threading.Thread):
    """Serves the record producers' delivery reports (they run as callbacks inside poll())."""

    def __init__(self, producer: ProducerLike, on_retired: Callable[[], None],
                 on_fatal: Callable[[KafkaError], None]) -> None:
        super().__init__(name="outbox-delivery", daemon=True)
        self.producer = producer
        self._retiring: list[ProducerLike] = []
        self._on_retired = on_retired
        self._on_fatal = on_fatal
        self._fatal_reported: set[int] = set()
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self.failure: BaseException | None = None

    def replace(self, producer: ProducerLike) -> None:
        """Poll `producer` from now on; keep polling the old one until all its reports are out."""
        with self._lock:
            self._retiring.append(self.producer)
            self.producer = producer

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                self._poll(self.producer, 0.05)
                if self._retiring:
                    self._serve_retiring()
        except BaseException as error:  # the harvester notices and stops as a whole
            self.failure = error
            log.exception("Delivery thread failed")

    def _poll(self, producer: ProducerLike, timeout: float) -> None:
        """poll(), where a fatal producer error (raised from it) goes to the core, once per producer:
        the producer's records then fail one by one, and the core replaces it."""
        try:
            producer.poll(timeout)
        except KafkaException as error:
            kafka_error = error.args[0] if error.args and isinstance(error.args[0], KafkaError) else None
            if kafka_error is None or not kafka_error.fatal():
                raise
            if id(producer) not in self._fatal_reported:
                self._fatal_reported.add(id(producer))
                self._on_fatal(kafka_error)
            elif timeout:
                self._stop_event.wait(timeout)

    def _serve_retiring(self) -> None:
        with self._lock:
            retiring = list(self._retiring)
        for old in retiring:
            self._poll(old, 0)
            if len(old) == 0:
                old.flush(0)
                with self._lock:
                    self._retiring.remove(old)
                self._on_retired()


class Harvester:
    """Harvests one outbox table; any number of replicas may run, exactly one leads."""

    def __init__(self, config: HarvestConfig, *, connector: Connector | None = None,
                 on_event: Callable[[events.Event], None] | None = None, instruments: Instruments | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._connector = connector if connector is not None else LiveConnector(config)
        self._on_event = on_event
        self._instruments = instruments or Instruments()
        self._clock = clock
        self._state = State.CREATED
        self._state_lock = threading.Lock()
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._failure: BaseException | None = None
        self._closing = False
        self._core = Core(config.limits, park_after=config.park_after, now=clock())
        # Handed over by other threads, taken in by the engine (deque appends are thread-safe).
        self._deliveries: deque[tuple[int, KafkaError | None]] = deque()
        self._inbox: deque[Callable[[Core], None]] = deque()
        self._wake_read, self._wake_write = -1, -1
        self._woken = False
        self._store: Store | None = None
        self._producer: ProducerLike | None = None
        self._dead_letter_producer: ProducerLike | None = None
        self._election: LeaderElection | None = None
        self._listener: ListenerLike | None = None
        self._has_trigger = False
        self._listening = False
        self._poller: DeliveryPoller | None = None
        self._fence_worker = Worker("outbox-fence")
        self._purge_worker = Worker("outbox-purge")
        self._status: StatusReporter | None = None
        self._engine: threading.Thread | None = None
        self._next_poll = 0.0
        self._started_at = datetime.now(UTC)
        self._since = self._started_at
        self._snapshot = self._core.snapshot()
        self._snapshot_at = 0.0
        self._meter_started = clock()
        self._meter_published = 0
        self.last_meter: events.MeterStats | None = None
        #: Postgres's estimate of the harvested table's live rows, refreshed with the status row.
        self.backlog: int | None = None

    # -- public view (safe from any thread) ------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

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
    def published(self) -> int:
        return self._snapshot.published

    @property
    def failed(self) -> int:
        return self._snapshot.failed

    def status(self) -> StatusSnapshot:
        """What this replica would report now."""
        snapshot = self._snapshot
        state = ReplicaState.STOPPING if self._state is State.STOPPING else snapshot.state
        meter = self.last_meter
        return StatusSnapshot(state=state, leader_id=snapshot.marking_id, since=self._since,
                              in_flight=snapshot.in_flight, queued=snapshot.queued,
                              in_flight_keys=snapshot.in_flight_keys, in_flight_key_count=snapshot.in_flight_key_count,
                              held=snapshot.held, blocked_by=snapshot.fence_holder,
                              throughput=meter.rate if meter else 0.0, published=snapshot.published,
                              failed=snapshot.failed)

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
                if isinstance(error, KafkaException):
                    raise HarvestError(f"cannot create a Kafka client: {kafka_reason(error)}") from None
                raise
            self._state = State.RUNNING
        self._engine = threading.Thread(target=self._run, name="outbox-engine", daemon=True)
        for thread in (self._poller, self._fence_worker, self._purge_worker, self._status):
            if thread is not None:
                thread.start()
        self._engine.start()
        log.info("Harvesting %s as %s (leader topic %s, group %s)", self.config.table, self.config.name,
                 self.config.leader_topic, self.config.leader_group)

    def _open(self) -> None:
        connector = self._connector
        self._store = connector.open_store()
        connector.ensure_leader_topic()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._producer = connector.record_producer()
        self._poller = DeliveryPoller(self._producer, self._on_producer_retired, self._on_producer_fatal)
        self._election = connector.leader_election()
        self._has_trigger = self._store.has_notify_trigger()
        self._listener = connector.listener(contract.notify_channel(self._store.table_oid))
        if self._listener is not None and not self._has_trigger:
            log.info("Table %s has no NOTIFY trigger (manage.py migrate installs it; docs/operations.md shows the "
                     "SQL for other tables): polling it every %gs", self.config.table, self.config.limits.mark_backoff)
        self._status = connector.status_reporter(self.status, self._set_backlog)
        self._election.start(self._on_assigned, self._on_revoked, self._on_lost)

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

    # -- the engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._check_threads()
                self._step()
            self._finish()
        except BaseException as error:
            self._failure = error
            log.error("Harvester stopping after a failure: %s", first_line(error), exc_info=error)
        finally:
            with self._state_lock:
                self._state = State.STOPPING
            self._close_resources()
            log.info("Stopped (published %d, failed %d)", self._core.published, self._core.failed)
            with self._state_lock:
                self._state = State.STOPPED
            self._stopped.set()

    def _check_threads(self) -> None:
        for thread in (self._poller, self._fence_worker, self._purge_worker):
            if thread is not None and thread.failure is not None:
                raise thread.failure

    def _step(self, *, poll: bool = True, max_wait: float | None = None) -> None:
        """One turn: tell the core the time and what happened, carry out its commands, then sleep
        until something happens or the core's next deadline (never past the next leader-topic poll)."""
        core = self._core
        now = self._clock()
        core.tick(now)
        if poll and now >= self._next_poll:
            self._next_poll = now + self.config.limits.min_poll_interval
            seen = self._election.poll(heartbeat=core.assigned)  # rebalance callbacks run in here
            core.on_polled()
            if seen:
                core.on_heartbeat_seen()
        self._absorb()
        self._execute(core.take_commands())
        self._refresh(now)
        deadline = core.next_deadline()
        if poll:
            deadline = min(deadline, self._next_poll)
        timeout = max(0.0, deadline - self._clock())
        self._wait(timeout if max_wait is None else min(timeout, max_wait))

    def _absorb(self) -> None:
        """Take in what the other threads handed over."""
        core = self._core
        deliveries = self._deliveries
        while deliveries:
            record_id, error = deliveries.popleft()
            core.on_delivered(record_id, None if error is None else delivery_error(error))
        inbox = self._inbox
        while inbox:
            inbox.popleft()(core)

    def _post(self, result: Callable[[Core], None]) -> None:
        """From another thread: hand a result to the engine and wake it."""
        self._inbox.append(result)
        self._wake()

    def _pump_until(self, done: Callable[[], bool], seconds: float, *, poll: bool) -> None:
        deadline = self._clock() + seconds
        while not done() and self._clock() < deadline:
            self._check_threads()
            self._step(poll=poll, max_wait=min(0.05, max(0.0, deadline - self._clock())))

    def _settle_timeout(self) -> float:
        return self.config.limits.delivery_timeout + 2 * self.config.limits.io_error_backoff + 1.0

    def _finish(self) -> None:
        """Graceful stop: send nothing more, let what is in flight settle (bounded), stay in the group meanwhile."""
        core = self._core
        core.stop()
        self._pump_until(lambda: core.settled, self._settle_timeout(), poll=True)
        if not core.settled:
            core.abort("stopping")
            self._pump_until(lambda: core.settled, 2.0, poll=True)
        if not core.settled:
            log.warning("Stopping with %d record(s) unsettled; the next leader re-marks them", core.in_flight)

    # -- leader election callbacks (inside the consumer's poll, on the engine thread) -------------

    def _on_assigned(self) -> None:
        self._core.on_assigned()

    def _on_revoked(self) -> None:
        core = self._core
        core.on_revoked()
        if self._closing:
            return
        # Kafka waits for this callback before assigning partition 0 elsewhere: settle what is in
        # flight first, so the next leader does not send it again.
        self._pump_until(lambda: core.settled, self._settle_timeout(), poll=False)
        if not core.settled:
            core.abort("partition 0 was revoked")
            self._pump_until(lambda: core.settled, 1.0, poll=False)

    def _on_lost(self) -> None:
        self._core.on_lost()

    # -- carrying out commands ------------------------------------------------------------------------

    def _execute(self, commands: list[cmd.Command]) -> None:
        for command in commands:
            handler = self._handlers[type(command)]
            handler(self, command)

    def _send(self, command: cmd.Send) -> None:
        producer = self._producer
        core = self._core
        delivered = self._delivered
        created_last: Any = None
        created_text = ""
        records = command.records
        for index, record in enumerate(records):
            created = record.create_time
            if created != created_last:  # a stash_many() batch shares one timestamp: format it once
                created_last, created_text = created, iso_utc(created)
            headers = [(contract.HEADER_ID, str(record.id)), (contract.HEADER_CREATE_TIME, created_text)]
            if record.header_keys:
                headers[:0] = zip(record.header_keys, record.header_values, strict=False)
            try:
                producer.produce(record.topic, value=record.value, key=record.key, headers=headers,
                                 on_delivery=functools.partial(delivered, record.id))
            except BufferError:
                # librdkafka's local queue is full: these go back to the front of their lanes.
                core.on_backpressure([r.id for r in records[index:]])
                return
            except KafkaException as error:
                kafka_error = error.args[0] if error.args and isinstance(error.args[0], KafkaError) else None
                if kafka_error is not None and kafka_error.fatal():
                    core.on_producer_failed(delivery_error(kafka_error))
                    core.on_backpressure([r.id for r in records[index:]])
                    return
                core.on_refused(record.id, delivery_error(kafka_error) if kafka_error is not None
                                else DeliveryError("ERROR", str(error), permanent=True))

    def _delivered(self, record_id: int, error: KafkaError | None, _message: Any) -> None:
        """The producer's on_delivery (on the delivery thread, inside poll())."""
        self._deliveries.append((record_id, error))
        if not self._woken:
            self._wake()

    def _abort_sends(self, command: cmd.AbortSends) -> None:
        try:
            self._producer.purge(in_queue=True, in_flight=True, blocking=False)
        except (KafkaException, NotImplementedError) as error:
            log.warning("Could not purge the record producer: %s", error)

    def _restart_producer(self, command: cmd.RestartProducer) -> None:
        old = self._producer
        try:
            old.purge(in_queue=True, in_flight=True, blocking=False)
        except (KafkaException, NotImplementedError):
            pass
        self._producer = self._connector.record_producer()
        self._poller.replace(self._producer)
        log.warning("Replaced the record producer")

    def _on_producer_retired(self) -> None:
        self._post(lambda core: core.on_producer_restarted())

    def _on_producer_fatal(self, error: KafkaError) -> None:
        """On the delivery thread: the record producer cannot go on."""
        self._post(lambda core: core.on_producer_failed(delivery_error(error)))

    def _announce(self, command: cmd.Announce) -> None:
        self._take_snapshot()  # what other threads read follows the event at once
        self._emit(command.event)

    # database commands run on the workers; their outcomes come back through the inbox

    def _take_fence(self, command: cmd.TakeFence) -> None:
        store = self._store

        def job() -> None:
            try:
                holder = store.take_fence()
            except psycopg.Error as error:
                message = first_line(error)
                self._post(lambda core: core.on_fence_failed(command.leader_id, message))
                return
            self._post(lambda core: core.on_fence(command.leader_id, holder is None,
                                                  None if holder is None else str(holder)))
        self._fence_worker.submit(job)

    def _release_fence(self, command: cmd.ReleaseFence) -> None:
        self._fence_worker.submit(self._store.release_fence)

    def _mark(self, command: cmd.Mark) -> None:
        store, instruments = self._store, self._instruments

        def job() -> None:
            began = time.perf_counter()
            try:
                records, snapshot = store.mark(command.leader_id, command.limit, command.after, command.upto)
            except psycopg.Error as error:
                message = first_line(error)
                self._post(lambda core: core.on_mark_failed(command, message))
                return
            instruments.marked(time.perf_counter() - began, len(records))
            self._post(lambda core: core.on_marked(command, records, snapshot))
        self._fence_worker.submit(job)

    def _check_held(self, command: cmd.CheckHeld) -> None:
        store = self._store

        def job() -> None:
            try:
                rows = store.check_held(command.ids)
            except psycopg.Error as error:
                message = first_line(error)
                self._post(lambda core: core.on_held_check_failed(message))
                return
            self._post(lambda core: core.on_held_checked(command, rows))
        self._fence_worker.submit(job)

    def _park(self, command: cmd.Park) -> None:
        store, config = self._store, self.config
        record = command.record

        def job() -> None:
            topic = self._publish_dead_letter(record, command.reason) if config.dead_letter_topic else None
            try:
                parked = store.park(record, command.reason, command.attempts, f"harvester {config.name}", topic)
            except (psycopg.Error, StoreError) as error:
                message = first_line(error)
                self._post(lambda core: core.on_park_failed(record.id, message))
                return
            if parked:
                log.warning("Parked record %d (key %r) in the dead-letter table after %d attempt(s): %s",
                            record.id, record.key, command.attempts, command.reason)
            self._post(lambda core: core.on_parked(record.id, parked))
        self._fence_worker.submit(job)

    def _publish_dead_letter(self, record: Record, reason: str) -> str | None:
        """Publish a parked record to the dead-letter topic (on the fence worker); its topic, or None."""
        topic = self.config.dead_letter_topic
        if self._dead_letter_producer is None:
            self._dead_letter_producer = self._connector.dead_letter_producer()
        outcome: list[KafkaError | None] = []
        headers = contract.dead_letter_headers(record.id, record.create_time, record.topic,
                                               list(zip(record.header_keys, record.header_values, strict=False)),
                                               reason)
        try:
            self._dead_letter_producer.produce(topic, value=record.value, key=record.key, headers=headers,
                                               on_delivery=lambda error, _message: outcome.append(error))
            self._dead_letter_producer.flush(self.config.limits.delivery_timeout)
        except (KafkaException, BufferError) as error:
            outcome.append(KafkaError(KafkaError._FAIL, str(error)))
        if outcome and outcome[0] is None:
            return topic
        reason_text = outcome[0].str() if outcome and outcome[0] is not None else "no acknowledgement"
        log.warning("Record %d not published to dead-letter topic %s (%s); parking it in the table only",
                    record.id, topic, reason_text)
        return None

    def _purge(self, command: cmd.Purge) -> None:
        store, instruments = self._store, self._instruments

        def job() -> None:
            began = time.perf_counter()
            try:
                _, held = store.purge(command.items)
            except psycopg.Error as error:
                message = first_line(error)
                self._post(lambda core: core.on_purge_failed(message))
                return
            instruments.purged(time.perf_counter() - began, len(command.items))
            self._post(lambda core: core.on_purged(held or not command.fenced))
        self._purge_worker.submit(job)

    def _reset(self, command: cmd.Reset) -> None:
        store, instruments = self._store, self._instruments

        def job() -> None:
            try:
                _, held = store.reset(command.items, command.errors)
            except psycopg.Error as error:
                message = first_line(error)
                self._post(lambda core: core.on_reset_failed(message))
                return
            instruments.reset(len(command.items))
            self._post(lambda core: core.on_reset(held or not command.fenced))
        self._purge_worker.submit(job)

    def _hold(self, command: cmd.Hold) -> None:
        store = self._store

        def job() -> None:
            try:
                version = store.hold(command.record_id, command.leader_id, command.reason)
            except psycopg.Error as error:
                log.warning("Could not note the error on record %d: %s", command.record_id, first_line(error))
                version = None
            self._post(lambda core: core.on_held(command.record_id, version))
        self._purge_worker.submit(job)

    _handlers: dict[type, Callable[[Harvester, Any], None]] = {
        cmd.Send: _send, cmd.AbortSends: _abort_sends, cmd.RestartProducer: _restart_producer,
        cmd.Announce: _announce, cmd.TakeFence: _take_fence, cmd.ReleaseFence: _release_fence, cmd.Mark: _mark,
        cmd.CheckHeld: _check_held, cmd.Park: _park, cmd.Purge: _purge, cmd.Reset: _reset, cmd.Hold: _hold,
    }

    # -- waiting, reporting ------------------------------------------------------------------------

    def _wake(self) -> None:
        self._woken = True
        if self._wake_write >= 0:
            try:
                os.write(self._wake_write, b"\0")
            except (BlockingIOError, OSError):
                pass  # the pipe is full (a wake is pending) or closed (stopping)

    def _wait(self, timeout: float) -> None:
        """Sleep until another thread hands something over, a NOTIFY arrives, or `timeout` passes."""
        if self._deliveries or self._inbox:
            timeout = 0.0
        readers = [self._wake_read]
        listener = self._listener
        listen_fd = listener.fileno() if listener is not None and self._core.leading else None
        listening = listen_fd is not None and self._has_trigger
        if listening != self._listening:
            self._listening = listening
            self._core.on_listening(listening)
        if listen_fd is not None:
            readers.append(listen_fd)
        ready, _, _ = select.select(readers, [], [], timeout) if timeout > 0 else select.select(readers, [], [], 0)
        if self._wake_read in ready:
            self._woken = False
            try:
                while os.read(self._wake_read, 4096):
                    pass
            except BlockingIOError:
                pass
        if listen_fd is not None and listen_fd in ready and listener.drain():
            self._core.on_notified()

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
            log.info("Throughput %.4g records/s (%d in %.1fs; %d published, %d failed, %d in flight)", stats.rate,
                     published, interval, stats.total_published, stats.total_failed, stats.in_flight)
        self._emit(events.MeterRead(stats))

    def _take_snapshot(self) -> None:
        self._snapshot_at = self._clock()
        previous = self._snapshot.state
        self._snapshot = self._core.snapshot()
        if self._snapshot.state is not previous:
            self._since = datetime.now(UTC)

    def _set_backlog(self, rows: int) -> None:
        self.backlog = rows

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
        for worker in (self._fence_worker, self._purge_worker):
            if worker.is_alive():
                worker.stop()
                worker.join(timeout=10)
        if self._election is not None:
            self._election.close()
        if self._poller is not None and self._poller.is_alive():
            self._poller.stop()
            self._poller.join(timeout=10)
        for producer in (self._producer, self._dead_letter_producer):
            if producer is not None:
                remaining = producer.flush(2.0)
                if remaining:
                    log.warning("%d message(s) still queued in a producer at close", remaining)
        if self._listener is not None:
            self._listener.close()
        if self._store is not None:
            self._store.close()
        for fd in (self._wake_read, self._wake_write):
            if fd >= 0:
                os.close(fd)
        self._wake_read = self._wake_write = -1
