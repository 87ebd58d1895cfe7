"""Mark / purge / reset: what happens to a record between the mark query and its purge.

Two threads share the work, as in goharvest:
- the engine thread owns `Pipeline`: marked records wait in per-key lanes, at most one record
  per key is in flight (the barrier), at most `max_in_flight_records` in all (the throttle);
- the delivery thread (`AckWorker`) serves the producer's delivery reports, purges delivered
  rows and resets failed ones in batches, and only then hands the records back to the engine,
  which lowers their keys' barriers. Lowering a barrier on the ack alone would let a crash
  between ack and purge replay R0 R1 after R1.

Unlike goharvest's send cells, a key that is waiting for its barrier never blocks records of
other keys: each key has its own lane.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
from confluent_kafka import KafkaError, KafkaException

from outbox.harvest.config import Limits
from outbox.harvest.instruments import Instruments
from outbox.harvest.kafka import ProducerLike
from outbox.harvest.store import Record, Store, first_line

log = logging.getLogger(__name__)

#: Delivery errors that will fail the same way on every retry: the record is held, not resent.
PERMANENT_ERRORS = frozenset({
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.INVALID_RECORD,
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.TOPIC_EXCEPTION,
    KafkaError.INVALID_REQUIRED_ACKS,
})
#: A held (poison) record is tried again after this long, in case its cause was fixed.
POISON_RETRY_AFTER = 60.0


@dataclass(frozen=True, slots=True)
class Settled:
    """A record whose delivery report has been acted on: purged (error None) or reset."""

    record: Record
    error: KafkaError | None


class Pipeline:
    """The engine thread's record state. Not thread-safe; the engine thread is its only user."""

    def __init__(self, limits: Limits, producer: ProducerLike, on_delivery: Callable[[Record], Any],
                 clock: Callable[[], float] = time.monotonic,
                 on_poison: Callable[[Record, str], None] | None = None) -> None:
        self._limits = limits
        self._producer = producer
        self._on_delivery = on_delivery
        self._on_poison = on_poison
        self._clock = clock
        #: key -> the record in flight for it (its barrier is raised until the purge commits).
        self.in_flight: dict[str, Record] = {}
        #: key -> records behind the key's in-flight or ready record, in id order.
        self._lanes: dict[str, deque[Record]] = {}
        #: records whose key is free, in mark order; sent as the throttle allows.
        self._ready: deque[Record] = deque()
        self.queued = 0
        #: keys held this term because a record of theirs cannot be published (poison) -> reason.
        self.held: dict[str, str] = {}
        #: record id -> (reason, when): records that failed permanently; held instead of resent.
        self._poisoned: dict[int, tuple[str, float]] = {}
        #: Set by a failed delivery or mark: stop sending, drain, and re-mark under a new leader id.
        self.force_remark = False
        self._last_created: Any = None
        self._last_created_text = ""

    # -- marking ------------------------------------------------------------------------------

    def wants_records(self) -> bool:
        """Mark more only while few records wait: memory stays bounded and marks stay cheap."""
        return not self.force_remark and self.queued < self._limits.mark_query_records

    def enqueue(self, records: Sequence[Record]) -> None:
        now = self._clock()
        for record in records:
            record.marked_at = now
            if record.key in self.held:
                continue  # stays marked by this term; retried under the next leader id
            lane = self._lanes.get(record.key)
            if lane is None:
                self._lanes[record.key] = deque()
                self._ready.append(record)
            else:
                lane.append(record)
            self.queued += 1

    # -- sending ------------------------------------------------------------------------------

    def can_send(self) -> bool:
        return bool(self._ready) and not self.force_remark and len(self.in_flight) < self._limits.max_in_flight_records

    def dispatch(self) -> None:
        """Send ready records while the throttle allows."""
        ready = self._ready
        while self.can_send():
            record = ready.popleft()
            self.queued -= 1
            poisoned = self._poisoned.get(record.id)
            if poisoned is not None and self._clock() - poisoned[1] < POISON_RETRY_AFTER:
                self._hold(record, poisoned[0])
                continue
            try:
                self._produce(record)
            except BufferError:
                # librdkafka's local queue is full: keep the record first in line and retry later.
                ready.appendleft(record)
                self.queued += 1
                break
            except KafkaException as error:
                # Refused before it left the process (too large, bad topic): it will fail the same
                # way every time, so hold its key rather than let it stall every other key.
                self.poison(record, kafka_error_text(error))
                continue
            self.in_flight[record.key] = record

    def _produce(self, record: Record) -> None:
        created = record.create_time
        if created != self._last_created:  # a stash_many() batch shares one timestamp: format it once
            self._last_created, self._last_created_text = created, iso_utc(created)
        headers = [("outbox-id", str(record.id)), ("outbox-create-time", self._last_created_text)]
        if record.header_keys:
            headers[:0] = zip(record.header_keys, record.header_values, strict=False)
        self._producer.produce(record.topic, value=record.value, key=record.key, headers=headers,
                               on_delivery=self._on_delivery(record))

    # -- settling -----------------------------------------------------------------------------

    def settle(self, settled: Sequence[Settled]) -> None:
        """Records purged or reset by the delivery thread: lower their keys' barriers."""
        for item in settled:
            record = item.record
            if item.error is not None:
                # The row was reset: anything marked after it must be re-marked first (goharvest B3).
                self.force_remark = True
                if is_permanent(item.error):
                    self._poisoned[record.id] = (item.error.str(), self._clock())
            if self.in_flight.get(record.key) is record:
                del self.in_flight[record.key]
                self._release(record.key)

    def _release(self, key: str) -> None:
        lane = self._lanes.get(key)
        if lane:
            self._ready.append(lane.popleft())
        else:
            self._lanes.pop(key, None)

    def poison(self, record: Record, reason: str) -> None:
        log.error("Holding key %r of topic %s: record %d cannot be published (%s); other keys go on",
                  record.key, record.topic, record.id, reason)
        self._poisoned[record.id] = (reason, self._clock())
        self._hold(record, reason)
        if self._on_poison is not None:
            self._on_poison(record, reason)

    def _hold(self, record: Record, reason: str) -> None:
        self.held[record.key] = reason
        lane = self._lanes.pop(record.key, None)
        if lane:
            self.queued -= len(lane)
        if len(self._poisoned) > 10_000:
            oldest = min(self._poisoned, key=lambda i: self._poisoned[i][1])
            del self._poisoned[oldest]

    # -- terms ----------------------------------------------------------------------------------

    def abandon(self) -> None:
        """Drop records not yet sent (they stay marked and are re-marked under the next leader id)."""
        self._ready.clear()
        self._lanes = {key: deque() for key in self.in_flight}
        self.queued = 0

    def new_term(self) -> None:
        """A fresh leader id begins: nothing may be in flight from the last one."""
        assert not self.in_flight, "a term starts only when the previous one has drained"
        self.abandon()
        self.held.clear()
        self.force_remark = False

    def oldest_queued_age(self) -> float:
        """Seconds the longest-waiting unsent record has waited since it was marked."""
        now = self._clock()
        oldest = min((record.marked_at for record in self._ready), default=now)
        for lane in self._lanes.values():
            if lane:
                oldest = min(oldest, lane[0].marked_at)
        return now - oldest


@dataclass(frozen=True, slots=True)
class Marked:
    """The outcome of one mark query: records marked for `leader_id`, or the error it raised."""

    leader_id: Any
    records: list[Record]
    error: BaseException | None = None


class Marker(threading.Thread):
    """Runs mark queries off the engine thread, one at a time, so the engine keeps sending and
    settling (and polling the leader topic) while the database works. A result for a leader id
    that is no longer current is discarded by the engine: those rows stay marked by an old id
    and the next mark picks them up again."""

    def __init__(self, store: Store, on_marked: Callable[[Marked], None], instruments: Instruments) -> None:
        super().__init__(name="outbox-marker", daemon=True)
        self._store = store
        self._instruments = instruments
        self._on_marked = on_marked
        self._requests: deque[tuple[Any, int]] = deque()
        self._signal = threading.Condition()
        self._stopping = False
        self.failure: BaseException | None = None

    def request(self, leader_id: Any, limit: int) -> None:
        with self._signal:
            self._requests.append((leader_id, limit))
            self._signal.notify()

    def stop(self) -> None:
        with self._signal:
            self._stopping = True
            self._signal.notify()

    def run(self) -> None:
        try:
            while True:
                with self._signal:
                    while not self._requests and not self._stopping:
                        self._signal.wait()
                    if self._stopping:
                        return
                    leader_id, limit = self._requests.popleft()
                try:
                    began = time.perf_counter()
                    records = self._store.mark(leader_id, limit)
                    self._instruments.marked(time.perf_counter() - began, len(records))
                    self._on_marked(Marked(leader_id, records))
                except psycopg.Error as error:
                    self._on_marked(Marked(leader_id, [], error))
        except BaseException as error:  # the harvester notices and stops as a whole
            self.failure = error
            log.exception("Marker thread failed")


class AckWorker(threading.Thread):
    """The delivery thread: polls the producer, purges or resets in batches, then reports back."""

    def __init__(self, producer: ProducerLike, store: Store, limits: Limits,
                 on_settled: Callable[[list[Settled]], None], instruments: Instruments) -> None:
        super().__init__(name="outbox-delivery", daemon=True)
        self._producer = producer
        self._store = store
        self._instruments = instruments
        self._limits = limits
        self._on_settled = on_settled
        self._reports: list[tuple[Record, KafkaError | None]] = []
        self._stop_event = threading.Event()
        self.failure: BaseException | None = None

    def callback_for(self, record: Record) -> Callable[[KafkaError | None, Any], None]:
        """The producer's on_delivery for one record; runs on this thread, inside poll()."""
        reports = self._reports
        return lambda error, _message: reports.append((record, error))

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                self._producer.poll(0.05)
                if self._reports:
                    self._settle()
        except BaseException as error:  # the harvester notices and stops as a whole
            self.failure = error
            log.exception("Delivery thread failed")

    def _settle(self) -> None:
        reports, self._reports[:] = list(self._reports), []
        delivered = [record.id for record, error in reports if error is None]
        failed = [(record, error) for record, error in reports if error is not None]
        if failed:  # one line per batch: a broker outage fails every record in flight at once
            record, error = failed[0]
            log.warning("Delivery failed for %d record(s), e.g. record %d (topic %s, key %r): %s; resetting them",
                        len(failed), record.id, record.topic, record.key, error.str())
        began = time.perf_counter()
        if delivered and not self._retry("purge", self._store.purge, delivered):
            return
        if delivered:
            self._instruments.purged(time.perf_counter() - began, len(delivered))
        if failed and not self._retry("reset", lambda ids: self._store.reset(ids, [e.str() for _, e in failed]),
                                      [record.id for record, _ in failed]):
            return
        if failed:
            self._instruments.reset(len(failed))
        self._on_settled([Settled(record, error) for record, error in reports])

    def _retry(self, what: str, statement: Callable[[list[int]], int], ids: list[int]) -> bool:
        """Run a purge or reset until it commits; the barriers stay raised meanwhile."""
        while True:
            try:
                statement(ids)
                return True
            except psycopg.Error as error:
                log.warning("%s of %d record(s) failed, retrying in %.1fs: %s", what.capitalize(), len(ids),
                            self._limits.io_error_backoff, first_line(error))
                if self._stop_event.wait(self._limits.io_error_backoff):
                    return False  # stopping: the rows stay marked and the next leader re-marks them


def iso_utc(created: datetime) -> str:
    """The outbox-create-time header: ISO 8601 in UTC."""
    return created.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def is_permanent(error: KafkaError) -> bool:
    return error.code() in PERMANENT_ERRORS and not error.retriable()


def kafka_error_text(error: KafkaException) -> str:
    inner = error.args[0] if error.args else None
    return inner.str() if isinstance(inner, KafkaError) else str(error)
