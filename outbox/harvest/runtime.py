"""The driver's real I/O: threads, database sessions, the record producer and the leader election.

Threads (each reports to the engine through Driver.post, never by touching the core):
- database workers, one per session (fence, purge): run the driver's jobs in order;
- delivery: polls the record producer, whose delivery reports go to the driver;
- election: polls the leader topic (Fast NELI): heartbeats, and the rebalance callbacks, which run
  on this thread, so a revoke waits here for the core to settle while the engine goes on;
- topics: reads the max.message.bytes of the topics records go to (topics.py), when first met and
  every topic_limits_interval;
and the engine thread (harvester.py), which runs the driver's turns and sleeps in `wait()`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from operator import methodcaller
from typing import Any

import psycopg
from confluent_kafka import KafkaError, KafkaException

from outbox.harvest import contract, events, partitions
from outbox.harvest.config import HarvestConfig
from outbox.harvest.connector import Connector, ListenerLike, Store
from outbox.harvest.contract import Record
from outbox.harvest.driver import FENCE_SESSION, PURGE_SESSION, Driver, delivery_error
from outbox.harvest.kafka import ProducerLike, record_producer_config
from outbox.harvest.neli import Election, ElectionPoll
from outbox.harvest.pipes import WakePipe, readable
from outbox.harvest.producers import RecordProducers
from outbox.harvest.store import close_quietly, connect
from outbox.harvest.topics import TopicLimits, TopicLimitsThread
from outbox.kafka.clients import LIBRDKAFKA_BATCH_SIZE
from outbox.kafka.sizes import limit_fitted_by
from outbox.reasons import first_line, kafka_error

log = logging.getLogger("outbox.harvest.harvester")

#: How long close() waits for each group of threads to end (the database workers, then the others).
THREADS_STOP_TIMEOUT = 10.0


class Worker(threading.Thread):
    """Runs jobs one at a time, in order, on a thread (and so a database session) of its own."""

    def __init__(self, name: str, store: Store) -> None:
        super().__init__(name=name, daemon=True)
        self._store = store
        self._jobs: deque[Callable[[Store], None] | None] = deque()
        self._signal = threading.Condition()
        self.failure: BaseException | None = None

    def submit(self, job: Callable[[Store], None]) -> None:
        with self._signal:
            self._jobs.append(job)
            self._signal.notify()

    def stop(self) -> None:
        """Finish the jobs already submitted, then end."""
        with self._signal:
            self._jobs.append(None)
            self._signal.notify()

    def run(self) -> None:
        try:
            while True:
                with self._signal:
                    while not self._jobs:
                        self._signal.wait()
                    job = self._jobs.popleft()
                if job is None:
                    return
                job(self._store)
        except BaseException as error:  # the harvester notices and stops as a whole
            self.failure = error
            log.exception("%s thread failed", self.name)


class DeliveryPoller(threading.Thread):
    """Serves the record producers' delivery reports (they run as callbacks inside poll()): the one in use, and
    those it replaced until they have reported everything (RecordProducers.serve_retiring)."""

    def __init__(self, producers: RecordProducers, on_fatal: Callable[[KafkaError], None]) -> None:
        super().__init__(name="outbox-delivery", daemon=True)
        self.producers = producers
        self._on_fatal = on_fatal
        self._fatal_reported: set[int] = set()
        self._stop_event = threading.Event()
        self.failure: BaseException | None = None

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        producers = self.producers
        try:
            while not self._stop_event.is_set():
                self._poll(producers.current, 0.05)
                producers.serve_retiring(self._poll)
        except BaseException as error:  # the harvester notices and stops as a whole
            self.failure = error
            log.exception("Delivery thread failed")

    def _poll(self, producer: ProducerLike, timeout: float) -> None:
        """poll(), where a fatal producer error (raised from it) goes to the core, once per producer:
        the producer's records then fail one by one, and the core replaces it."""
        try:
            producer.poll(timeout)
        except KafkaException as error:
            found = kafka_error(error)
            if found is None or not found.fatal():
                raise
            if id(producer) not in self._fatal_reported:
                self._fatal_reported.add(id(producer))
                self._on_fatal(found)
            elif timeout:
                self._stop_event.wait(timeout)


class ElectionThread(threading.Thread):
    """Runs the election's step (neli.ElectionPoll) every min_poll_interval: heartbeats out and back, and the
    rebalance callbacks. A revoke waits here, in Kafka's callback, until the core answers ReleasePartition."""

    def __init__(self, election: Election, driver: Driver, interval: float) -> None:
        super().__init__(name="outbox-election", daemon=True)
        self.poll = ElectionPoll(election, driver.post, self._hold)
        self._interval = interval
        self._released = threading.Event()
        self._stop_event = threading.Event()
        self.failure: BaseException | None = None

    def release(self) -> None:
        self._released.set()

    def stop(self) -> None:
        """Stop polling and leave the group (a revoke callback under way returns at once)."""
        self._stop_event.set()

    def run(self) -> None:
        try:
            self.poll.start()
            while not self._stop_event.is_set():
                self.poll.step()
                self._stop_event.wait(self._interval)
        except BaseException as error:  # the harvester notices and stops as a whole
            self.failure = error
            log.error("Leader election failed: %s", error)
        finally:
            self.poll.close()  # the revoke callback it runs returns at once: nothing is in flight

    def _hold(self, announce: Callable[[], None]) -> None:
        if self._stop_event.is_set():
            return
        self._released.clear()
        announce()
        # Kafka hands partition 0 on once this returns: wait for what is in flight to settle.
        while not self._released.wait(0.1):
            if self._stop_event.is_set():
                return


class PartitionKeeper(threading.Thread):
    """While this replica leads a partitioned outbox: one pass of partitions.keep() every KEEP_INTERVAL,
    on a connection of its own (its locks are tried briefly, so it never keeps the engine waiting)."""

    def __init__(self, dsn: str, table: str, leading: Callable[[], bool],
                 waited: Callable[[str, float, int], None] | None = None) -> None:
        super().__init__(name="outbox-partitions", daemon=True)
        self._dsn, self._table, self._leading = dsn, table, leading
        #: Told each pass's round trips to the database (kind "partitions", dbtime.py), a failed one too.
        self._waited = waited or (lambda kind, seconds, rows: None)
        self._stop_event = threading.Event()
        self.failure: BaseException | None = None

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        conn: psycopg.Connection | None = None
        try:
            while not self._stop_event.wait(partitions.KEEP_INTERVAL):
                if not self._leading():
                    continue
                began = time.perf_counter()
                try:
                    conn = conn if conn is not None and not conn.closed else connect(self._dsn, "partitions")
                    kept = partitions.keep(conn, self._table)
                except psycopg.Error as error:
                    self._waited("partitions", time.perf_counter() - began, 0)
                    log.warning("Partition upkeep of %s failed (tried again in %gs): %s", self._table,
                                partitions.KEEP_INTERVAL, first_line(error))
                    close_quietly(conn)
                    conn = None
                    continue
                self._waited("partitions", time.perf_counter() - began,
                             len(kept.created) + len(kept.truncated) + len(kept.dropped))
                if kept.created or kept.truncated or kept.dropped:
                    log.info("Partitions of %s: created %s, truncated %s, dropped %s", self._table,
                             kept.created or "none", kept.truncated or "none", kept.dropped or "none")
        except BaseException as error:  # the harvester notices and stops as a whole
            self.failure = error
            log.exception("Partition upkeep thread failed")
        finally:
            close_quietly(conn)


class ThreadedIO:
    """EngineIO over real clients and threads; owns them from open() to close()."""

    def __init__(self, config: HarvestConfig, connector: Connector, clock: Callable[[], float],
                 on_event: Callable[[events.Event], None]) -> None:
        self.config = config
        self._connector = connector
        self.now = clock
        self._on_event = on_event
        self.driver: Driver | None = None
        self.store: Store | None = None
        self._producers: RecordProducers | None = None
        self._dead_letter_producer: ProducerLike | None = None
        self._listener: ListenerLike | None = None
        #: The table's NOTIFY channel, until the engine first leads and asks for its listener (a standby holds
        #: no LISTEN session); None once asked.
        self._channel: str | None = None
        self._has_trigger = False
        self._listening = False
        self._leading = False
        self._wake: WakePipe | None = None
        self._woken = False
        self._workers: dict[str, Worker] = {}
        self._poller: DeliveryPoller | None = None
        self._election: ElectionThread | None = None
        self._keeper: PartitionKeeper | None = None
        self._topics: TopicLimitsThread | None = None
        self.topic_limits: TopicLimits | None = None
        #: The record producer's batches fit a topic whose max.message.bytes is at least this (topics.py).
        self._batch_limit = limit_fitted_by(_batch_size(record_producer_config(config)))

    # -- life -----------------------------------------------------------------------------------

    def open(self, driver: Driver) -> None:
        """Connect everything; raises (StoreError, KafkaUnavailable, KafkaException) with close() still owed."""
        self.driver = driver
        driver.wake = self.wake
        connector = self._connector
        self.store = connector.open_store()
        connector.ensure_leader_topic()
        self._wake = WakePipe()
        self.topic_limits = connector.topic_limits()
        self._topics = TopicLimitsThread(self.topic_limits)
        self._producers = RecordProducers(self._record_producer, self._batch_limit,
                                          lambda: driver.post(methodcaller("on_producer_restarted")))
        self._poller = DeliveryPoller(self._producers, self._producer_failed)
        self._election = ElectionThread(connector.leader_election(), driver, self.config.limits.min_poll_interval)
        self._has_trigger = self.store.has_notify_trigger()
        self._channel = contract.notify_channel(self.store.table_oid) if self.config.listen else None
        if self._channel is not None and not self._has_trigger:
            log.info("Table %s has no NOTIFY trigger (manage.py migrate, or outbox-harvest schema --apply, installs "
                     "it; docs/tuning.md shows the SQL for other tables): polling it every %gs", self.config.table,
                     self.config.limits.mark_backoff)
        self._workers = {FENCE_SESSION: Worker("outbox-fence", self.store),
                         PURGE_SESSION: Worker("outbox-purge", self.store)}
        if self.store.partitioned:
            self._keeper = PartitionKeeper(self.config.dsn, self.config.table, lambda: self._leading, driver.waited)

    def start(self) -> None:
        for thread in (self._poller, *self._workers.values(), self._election, self._keeper, self._topics):
            if thread is not None:
                thread.start()

    def failure(self) -> BaseException | None:
        """Why a thread of this runtime died, if one did."""
        for thread in (self._poller, *self._workers.values(), self._election, self._keeper, self._topics):
            if thread is not None and thread.failure is not None:
                return thread.failure
        return None

    def close(self) -> None:
        """Stop the threads, then close the clients and sessions: the database workers first (their last jobs, a
        purge among them, done before the group is left and a standby takes over), then the others together, each
        group waited for at most THREADS_STOP_TIMEOUT in all (a thread still stuck in a call is a daemon, left
        behind). A stop so bounded ends within about twice that plus the producers' flush, where one after the
        other a stuck thread each could hold it for a minute."""
        for group in (list(self._workers.values()), [self._election, self._keeper, self._poller, self._topics]):
            running = [thread for thread in group if thread is not None and thread.is_alive()]
            for thread in running:
                thread.stop()
            deadline = time.monotonic() + THREADS_STOP_TIMEOUT
            for thread in running:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        for producer in (self.producer, self._dead_letter_producer):
            if producer is not None:
                remaining = producer.flush(2.0)
                if remaining:
                    log.warning("%d message(s) still queued in a producer at close", remaining)
        if self._listener is not None:
            self._listener.close()
        if self.store is not None:
            self.store.close()
        if self._wake is not None:
            self._wake.close()

    # -- EngineIO -------------------------------------------------------------------------------

    def submit(self, session: str, job: Callable[[Store], None]) -> None:
        self._workers[session].submit(job)

    @property
    def producer(self) -> ProducerLike | None:
        """The record producer in use (None before open() built one)."""
        return self._producers.current if self._producers is not None else None

    @property
    def batch_limit(self) -> int:
        return self._producers.batch_limit if self._producers is not None else self._batch_limit

    def _record_producer(self, batch_limit: int | None) -> ProducerLike:
        self._connector.batch_limit = batch_limit
        return self._connector.record_producer()

    def restart_producer(self) -> None:
        self._producers.restart()

    def topic_limit(self, topic: str) -> int | None:
        return self.topic_limits.limit(topic)

    def topic_limit_stale(self, topic: str) -> bool:
        return self.topic_limits is not None and self.topic_limits.stale(topic)

    def fit_batches(self, limit: int) -> bool:
        return self._producers.fit(limit)

    def refused_for_size(self, topic: str | None) -> None:
        """Kafka refused a batch for its size: the topic's limit must be read again (it was lowered)."""
        if self.topic_limits is not None:
            self.topic_limits.invalidate(topic)

    def _producer_failed(self, error: KafkaError) -> None:
        self.refused_for_size(None)  # a refused batch is the usual cause: read every limit again
        self.driver.post(lambda core: core.on_producer_failed(delivery_error(error)))

    def release_partition(self) -> None:
        self._election.release()

    def leadership(self, *, assigned: bool, leading: bool) -> None:
        self._election.poll.heartbeat = assigned
        self._leading = leading

    def announce(self, event: events.Event) -> None:
        self._on_event(event)

    def publish_dead_letter(self, record: Record, reason: str) -> str | None:
        topic = self.config.dead_letter_topic
        if not topic:
            return None
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

    # -- waking and waiting ----------------------------------------------------------------------

    def wake(self) -> None:
        """From any thread: end the engine's wait()."""
        if self._woken:
            return
        self._woken = True
        if self._wake is not None:
            self._wake.wake()

    def wait(self, deadline: float) -> None:
        """Sleep until another thread hands something over, a NOTIFY arrives, or `deadline`."""
        driver = self.driver
        timeout = 0.0 if driver.pending else max(0.0, deadline - self.now())
        wake = self._wake
        readers = [wake.fileno()]
        if self._leading and self._channel is not None:
            self._listener = self._connector.listener(self._channel)  # the process's LISTEN hub for its database
            self._channel = None
        listener = self._listener
        listen_fd = listener.fileno() if listener is not None and self._leading else None
        listening = listen_fd is not None and self._has_trigger
        if listening != self._listening:
            self._listening = listening
            driver.post(lambda core: core.on_listening(listening))
        if listen_fd is not None:
            readers.append(listen_fd)
        ready = readable(readers, timeout)
        if wake.fileno() in ready:
            wake.drain()
            # Cleared after draining: a wake() that found it still set appended its item before
            # this, so the next turn takes that item in; one that finds it clear writes again.
            self._woken = False
        if listen_fd is not None and listen_fd in ready and listener.drain():
            driver.post(methodcaller("on_notified"))


def _batch_size(settings: dict[str, Any]) -> int:
    try:
        return int(settings.get("batch.size", LIBRDKAFKA_BATCH_SIZE))
    except (TypeError, ValueError):
        return LIBRDKAFKA_BATCH_SIZE
