"""The one step loop: it turns the core's commands into database and Kafka calls and feeds the
answers back. The threaded harvester (harvester.py) and the simulator (tests/sim/) run this same
code over different I/O; only how a job reaches a database session, how a producer is replaced
and how time passes differ (`EngineIO`).

A turn: tell the core the time, hand it everything that arrived since the last turn (delivery
reports, database answers, leader-election events: other threads post them), carry out the
commands it answers with, and return the time it wants its next turn. Nothing here blocks and
nothing re-enters a turn: a revoke or a stop waits for its records to settle through deadlines
the core keeps, not through a nested loop.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import psycopg
from confluent_kafka import KafkaError, KafkaException

from outbox.harvest import commands as cmd
from outbox.harvest import contract, events
from outbox.harvest.acks import AckOffsets
from outbox.harvest.commands import DeliveryError
from outbox.harvest.connector import Store
from outbox.harvest.contract import Record, iso_utc
from outbox.harvest.core import Core
from outbox.harvest.dbtime import RoundTrips
from outbox.harvest.instruments import Instruments
from outbox.harvest.kafka import ProducerLike
from outbox.harvest.store import StoreError
from outbox.harvest.tracing import PublishTracer
from outbox.kafka.sizes import UNLIMITED, fits, record_size, too_large
from outbox.reasons import first_line, kafka_error

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

#: Kafka refused a batch for its size: the topic's max.message.bytes is read again.
SIZE_ERRORS = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE})

#: The database sessions jobs run on. The fence session holds the table's fence and marks (so a
#: leader that lost the fence can mark nothing); the purge session settles, so settling never waits
#: behind a mark. Each runs its jobs one at a time, in order.
FENCE_SESSION = "fence"
PURGE_SESSION = "purge"

Result = Callable[[Core], None]


def delivery_error(error: KafkaError) -> DeliveryError:
    """Kafka's error, as the core sees it."""
    permanent = error.code() in PERMANENT_ERRORS and not error.retriable()
    return DeliveryError(error.name(), error.str(), permanent=permanent, fatal=error.fatal())


class EngineIO(Protocol):
    """What the driver needs from its runtime."""

    @property
    def producer(self) -> ProducerLike:
        """The record producer in use."""

    def now(self) -> float: ...

    @property
    def batch_limit(self) -> int:
        """The record producer's batches fit this many bytes (topics.UNLIMITED: librdkafka's batch.size)."""

    def topic_limit(self, topic: str) -> int | None:
        """The topic's max.message.bytes (topics.UNLIMITED if it cannot be known), or None while it is
        being read (the records wait)."""

    def topic_limit_stale(self, topic: str) -> bool:
        """Whether a record over `topic`'s limit waits for the limit to be read again before it is held (the limit
        is old: it may have been raised since); asks for it (topics.TopicLimits.stale)."""

    def fit_batches(self, limit: int) -> bool:
        """Make the record producer's batches fit `limit` bytes; False while that waits for the
        producer to report what it holds (send nothing meanwhile)."""

    def refused_for_size(self, topic: str | None) -> None:
        """Kafka refused a batch of `topic` (None: of some topic) for its size: read its limit again."""

    def submit(self, session: str, job: Callable[[Store], None]) -> None:
        """Run `job` on a database session (FENCE_SESSION or PURGE_SESSION), after the jobs before it."""

    def restart_producer(self) -> None:
        """Purge the record producer and put a new one in its place; once the old one has reported
        every record it held, post Core.on_producer_restarted."""

    def publish_dead_letter(self, record: Record, reason: str) -> str | None:
        """Publish a parked record to the dead-letter topic, if one is configured (on the fence
        session's thread); returns the topic it reached, or None."""

    def release_partition(self) -> None:
        """Let the revoke of partition 0 complete (Kafka may give it to another replica)."""

    def leadership(self, *, assigned: bool, leading: bool) -> None:
        """The core's view after a turn: heartbeats are published while assigned; NOTIFYs wake it while leading."""

    def announce(self, event: events.Event) -> None: ...


class Driver:
    """The core plus the step loop. `post` and `delivered` may be called from any thread; the rest
    only from the thread that runs turns."""

    def __init__(self, core: Core, io: EngineIO, *, instruments: Instruments | None = None,
                 parked_by: str = "harvester", tracer: PublishTracer | None = None) -> None:
        self.core = core
        self.io = io
        self._instruments = instruments or Instruments()
        #: Every database job's round trip, by kind (dbtime.py): what the harvester waits on the database for.
        self.round_trips = RoundTrips()
        self._parked_by = parked_by
        self._tracer = tracer
        #: Tracer handles of failed records, by record id: put by the delivery thread before its report,
        #: taken by the turn that hands the core the report (or by _send, for a record refused before it
        #: was produced), and ended at the end of the turn after, so a Hold the core answers with is
        #: recorded on them.
        self._failed_spans: dict[int, Any] = {}
        self._turn_failures: dict[int, Any] = {}
        self._older_failures: dict[int, Any] = {}
        # Appended by other threads, taken in by turn() (deque appends and pops are thread-safe).
        self._inbox: deque[Result] = deque()
        self._deliveries: deque[tuple[int, KafkaError | None]] = deque()
        self.wake: Callable[[], None] = lambda: None
        #: The offsets the record producer in use was acknowledged at (acks.py), and that producer.
        self._acks = AckOffsets()
        self._acks_of: Any = None

    @property
    def pending(self) -> bool:
        """Something arrived that the next turn will take in."""
        return bool(self._inbox or self._deliveries)

    def post(self, result: Result) -> None:
        """From any thread: hand the core an answer or an event at its next turn."""
        self._inbox.append(result)
        self.wake()

    def delivered(self, record_id: int, error: KafkaError | None) -> None:
        """A delivery report for a record sent by Send (any thread)."""
        self._deliveries.append((record_id, error))
        self.wake()

    def turn(self) -> float:
        """One turn; returns the time of the core's next deadline."""
        core, io = self.core, self.io
        core.tick(io.now())
        deliveries, inbox = self._deliveries, self._inbox
        while deliveries or inbox:
            while deliveries:
                record_id, error = deliveries.popleft()
                if error is not None and self._failed_spans:
                    span = self._failed_spans.pop(record_id, None)
                    if span is not None:
                        self._turn_failures[record_id] = span
                core.on_delivered(record_id, None if error is None else delivery_error(error))
            while inbox:
                inbox.popleft()(core)
        for command in core.take_commands():
            getattr(self, self._handlers[type(command)])(command)
        if self._turn_failures or self._older_failures:
            self._end_failed_spans()
        io.leadership(assigned=core.assigned, leading=core.leading)
        return core.next_deadline()

    # -- Kafka ------------------------------------------------------------------------------------

    def _send(self, command: cmd.Send) -> None:
        io, core = self.io, self.core
        records = command.records
        limits: dict[str, int | None] = {}
        for record in records:
            if record.topic not in limits:
                limits[record.topic] = io.topic_limit(record.topic)
        smallest = min((limit for limit in limits.values() if limit is not None), default=UNLIMITED)
        if smallest < io.batch_limit and not io.fit_batches(smallest):
            # The producer is rebuilt with smaller batches once it has reported what it holds.
            core.on_backpressure([r.id for r in records])
            return
        producer = io.producer
        if producer is not self._acks_of:  # a new producer is a new idempotent session
            replaced = self._acks_of is not None
            self._acks_of, self._acks = producer, AckOffsets()
            if replaced:
                # Its first record of each key must go alone (lanes.py): these were batched for the old one.
                core.on_producer_replaced()
                core.on_backpressure([r.id for r in records])
                return
        acks = self._acks
        delivered = self._on_delivery
        created_last: Any = None
        created_text = ""
        # Keys whose record was refused or waits for its topic's limit: later ones must not go out ahead.
        stopped_keys: set[str] = set()
        held_back: list[int] = []
        tracer = self._tracer
        handles: Sequence[Any] = ()  # with a tracer, each record's handle, by position (None: not traced)
        if tracer is not None:
            if None not in limits.values():
                handles = tracer.sending(records)
            else:  # records whose topic's limit is still being read wait unsent: no span for them yet
                traced = [r for r in records if limits[r.topic] is not None]
                by_id = dict(zip((r.id for r in traced), tracer.sending(traced), strict=True)) if traced else {}
                handles = [by_id.get(r.id) for r in records]
        for index, record in enumerate(records):
            limit = limits[record.topic]
            if record.key in stopped_keys or limit is None:
                stopped_keys.add(record.key)
                held_back.append(record.id)
                if tracer is not None and handles[index] is not None:
                    tracer.end(handles[index])
                continue
            created = record.create_time
            if created != created_last:  # a stash_many() batch shares one timestamp: format it once
                created_last, created_text = created, iso_utc(created)
            headers = [(contract.HEADER_ID, str(record.id)), (contract.HEADER_CREATE_TIME, created_text)]
            if record.header_keys:
                headers[:0] = zip(record.header_keys, record.header_values, strict=False)
                if contract.CE_SPECVERSION in record.header_keys:
                    headers.extend(contract.cloudevent_headers(record.id, created_text, record.header_keys))
            if limit < UNLIMITED and not fits(record.key, record.value, headers, limit):
                stopped_keys.add(record.key)
                if io.topic_limit_stale(record.topic):  # read again first: it waits, as for an unknown limit
                    held_back.append(record.id)
                    if tracer is not None and handles[index] is not None:
                        tracer.end(handles[index])
                    continue
                # Held before it is produced: a refused batch would fail every key's records with it.
                size = record_size(record.key, record.value, headers)
                failure = DeliveryError("MSG_SIZE_TOO_LARGE", too_large(size, limit, record.topic), permanent=True)
                if tracer is not None:
                    tracer.failed(handles[index], record.id, failure)
                    self._turn_failures[record.id] = handles[index]  # ended after the Hold it may bring
                core.on_refused(record.id, failure)
                continue
            if tracer is None:
                on_delivery = functools.partial(delivered, record.id, acks)
            else:
                on_delivery = functools.partial(self._on_traced_delivery, record.id, acks, handles[index])
            try:
                producer.produce(record.topic, value=record.value, key=record.key, headers=headers,
                                 on_delivery=on_delivery)
            except BufferError:
                # The producer's local queue is full: these go back to the front of their lanes.
                if tracer is not None:
                    for handle in handles[index:]:  # never produced: sent again later, traced again then
                        if handle is not None:
                            tracer.end(handle)
                core.on_backpressure([*held_back, *(r.id for r in records[index:])])
                return
            except KafkaException as error:
                found = kafka_error(error)
                failure = (delivery_error(found) if found is not None
                           else DeliveryError("ERROR", str(error), permanent=True))
                if tracer is not None:
                    tracer.failed(handles[index], record.id, failure)
                    self._turn_failures[record.id] = handles[index]  # ended after the Hold it may bring
                if found is not None and found.fatal():
                    if tracer is not None:
                        for handle in handles[index + 1:]:
                            if handle is not None:
                                tracer.end(handle)
                    core.on_producer_failed(failure)
                    core.on_backpressure([*held_back, *(r.id for r in records[index:])])
                    return
                stopped_keys.add(record.key)
                core.on_refused(record.id, failure)
        if held_back:
            core.on_backpressure(held_back)

    def _on_delivery(self, record_id: int, acks: AckOffsets, error: KafkaError | None, message: Any) -> None:
        if error is None:
            error = self._not_delivered(acks, message)
        elif error.code() in SIZE_ERRORS:
            self.io.refused_for_size(None)  # one request reads every topic's limit again
        self.delivered(record_id, error)

    def _on_traced_delivery(self, record_id: int, acks: AckOffsets, handle: Any, error: KafkaError | None,
                            message: Any) -> None:
        tracer = self._tracer
        assert tracer is not None
        if error is None:
            error = self._not_delivered(acks, message)
            if error is None:
                tracer.acknowledged(handle, message)
                self.delivered(record_id, None)
                return
        tracer.failed(handle, record_id, delivery_error(error))
        self._failed_spans[record_id] = handle  # before the report, so the turn that takes it finds it
        self._on_delivery(record_id, acks, error, message)

    def _not_delivered(self, acks: AckOffsets, message: Any) -> KafkaError | None:
        """A report of delivery that Kafka gave for a batch it took for a duplicate (acks.py), as a failure
        to retry; None for a delivery."""
        reason = acks.repeated(message)
        if reason is None:
            return None
        return KafkaError(KafkaError.DUPLICATE_SEQUENCE_NUMBER, reason, retriable=True)

    def _end_failed_spans(self) -> None:
        tracer = self._tracer
        assert tracer is not None
        for handle in self._older_failures.values():
            tracer.end(handle)
        self._older_failures, self._turn_failures = self._turn_failures, {}

    def _abort_sends(self, command: cmd.AbortSends) -> None:
        try:
            self.io.producer.purge(in_queue=True, in_flight=True, blocking=False)
        except (KafkaException, NotImplementedError) as error:
            log.warning("Could not purge the record producer: %s", error)

    def _restart_producer(self, command: cmd.RestartProducer) -> None:
        self.io.restart_producer()
        log.warning("Replaced the record producer")

    def _release_partition(self, command: cmd.ReleasePartition) -> None:
        self.io.release_partition()

    def _announce(self, command: cmd.Announce) -> None:
        self.io.announce(command.event)

    # -- the database -----------------------------------------------------------------------------

    def _run(self, session: str, call: Callable[[Store], Any], done: Callable[[Core, Any], None],
             failed: Callable[[Core, str], None] | None) -> None:
        """Run `call` on a session; its result (or the first line of its error) reaches the core
        through `done` (or `failed`) at the next turn, never at once."""

        def job(store: Store) -> None:
            try:
                result = call(store)
            except (psycopg.Error, StoreError) as error:
                if failed is not None:
                    message = first_line(error)
                    self.post(lambda core: failed(core, message))
                return
            self.post(lambda core: done(core, result))
        self.io.submit(session, job)

    def waited(self, kind: str, seconds: float, rows: int) -> None:
        """One round trip of a job (any thread: the sessions', the partition keeper's): tallied, and told to the
        instruments."""
        self.round_trips.add(kind, seconds, rows)
        self._instruments.database(kind, seconds, rows)

    def _timed(self, kind: str, call: Callable[[Store], Any], rows: Callable[[Any], int]) -> Callable[[Store], Any]:
        """`call`, with its round trip timed as `kind` (a failed one too: it cost the database as well)."""

        def timed(store: Store) -> Any:
            began = time.perf_counter()
            try:
                result = call(store)
            except BaseException:
                self.waited(kind, time.perf_counter() - began, 0)
                raise
            self.waited(kind, time.perf_counter() - began, rows(result))
            return result
        return timed

    def _take_fence(self, command: cmd.TakeFence) -> None:
        leader_id = command.leader_id

        def answered(core: Core, taken: tuple[object, str | None]) -> None:
            holder, unsettled = taken
            core.on_fence(leader_id, holder is None, None if holder is None else str(holder),
                          same_group=bool(getattr(holder, "same_group", False)), unsettled=unsettled)

        def take(store: Store) -> tuple[object, str | None]:
            holder = store.take_fence(end_stale=command.end_stale)
            return holder, getattr(store, "unsettled_predecessor", None) if holder is None else None

        self._run(FENCE_SESSION, self._timed("fence", take, _no_rows), answered,
                  lambda core, error: core.on_fence_failed(leader_id, error))

    def _release_fence(self, command: cmd.ReleaseFence) -> None:
        settled = command.settled
        self._run(FENCE_SESSION, self._timed("fence", lambda store: store.release_fence(settled=settled), _no_rows),
                  lambda core, _: None, None)

    def _mark(self, command: cmd.Mark) -> None:
        instruments = self._instruments

        def mark(store: Store) -> tuple[list[Record], frozenset[str] | None]:
            began = time.perf_counter()
            records, writers = store.mark(command.limit, command.after, command.gaps)
            instruments.marked(time.perf_counter() - began, len(records))
            return records, writers

        self._run(FENCE_SESSION, self._timed("mark", mark, lambda answer: len(answer[0])),
                  lambda core, result: core.on_marked(command, *result),
                  lambda core, error: core.on_mark_failed(command, error))

    def _check_held(self, command: cmd.CheckHeld) -> None:
        self._run(FENCE_SESSION, self._timed("check_held", lambda store: store.check_held(command.ids), len),
                  lambda core, rows: core.on_held_checked(command, rows),
                  lambda core, error: core.on_held_check_failed(error))

    def _park(self, command: cmd.Park) -> None:
        record, io = command.record, self.io

        def park(store: Store) -> bool:
            topic = io.publish_dead_letter(record, command.reason)  # Kafka's time, not the database's
            move = self._timed("park", lambda store: store.park(record, command.reason, command.attempts,
                                                                self._parked_by, topic), int)
            parked = move(store)
            if parked and self._tracer is not None:
                self._tracer.parked(record, command.reason, command.attempts, topic)
            if parked:
                log.warning("Parked record %d (key %r) in the dead-letter table after %d attempt(s): %s",
                            record.id, record.key, command.attempts, command.reason)
            return parked

        self._run(FENCE_SESSION, park, lambda core, parked: core.on_parked(record.id, parked),
                  lambda core, error: core.on_park_failed(record.id, error))

    def _purge(self, command: cmd.Purge) -> None:
        instruments = self._instruments
        delete = self._timed("purge", lambda store: store.purge(command.ids, command.fenced, command.durable),
                             lambda answer: answer[0])

        def purge(store: Store) -> bool:
            began = time.perf_counter()
            _, held = delete(store)
            instruments.purged(time.perf_counter() - began, len(command.ids))
            return held

        self._run(PURGE_SESSION, purge, lambda core, held: core.on_purged(held or not command.fenced),
                  lambda core, error: core.on_purge_failed(error))

    def _reset(self, command: cmd.Reset) -> None:
        instruments = self._instruments
        update = self._timed("reset", lambda store: store.reset(command.ids, command.errors), lambda answer: answer[0])

        def reset(store: Store) -> bool:
            _, held = update(store)
            instruments.reset(len(command.ids))
            return held

        self._run(PURGE_SESSION, reset, lambda core, held: core.on_reset(held or not command.fenced),
                  lambda core, error: core.on_reset_failed(error))

    def _hold(self, command: cmd.Hold) -> None:
        record_id = command.record_id
        handle = self._turn_failures.get(record_id) or self._older_failures.get(record_id)
        if handle is not None and self._tracer is not None:
            self._tracer.held(handle, record_id, command.reason)

        def noted(core: Core, error: str) -> None:
            log.warning("Could not note the error on record %d: %s", record_id, error)
            core.on_held(record_id, None)

        self._run(PURGE_SESSION, self._timed("hold", lambda store: store.hold(record_id, command.reason),
                                             lambda version: int(version is not None)),
                  lambda core, version: core.on_held(record_id, version), noted)

    #: Each command's handler, by name (so a subclass's override is the one called).
    _handlers: dict[type, str] = {
        cmd.Send: "_send", cmd.AbortSends: "_abort_sends", cmd.RestartProducer: "_restart_producer",
        cmd.ReleasePartition: "_release_partition", cmd.Announce: "_announce", cmd.TakeFence: "_take_fence",
        cmd.ReleaseFence: "_release_fence", cmd.Mark: "_mark", cmd.CheckHeld: "_check_held", cmd.Park: "_park",
        cmd.Purge: "_purge", cmd.Reset: "_reset", cmd.Hold: "_hold",
    }


def _no_rows(_result: Any) -> int:
    return 0
