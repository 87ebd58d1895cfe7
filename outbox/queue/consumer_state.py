"""What a queue consumer knows and decides, with no I/O: the consumer's state machine.

QueueConsumer (markers_consumer.py) owns the Kafka clients and the threads and asks this object what to
do; the simulator (tests/sim/) runs the same object on its own clock. Times are the consumer's
local monotonic seconds, passed in.

Decisions made here:
- back-pressure: at most max_in_progress messages are held (buffered or received, not yet
  settled); held full for FULL_PAUSE_AFTER, the consumer pauses its partitions and keeps
  polling (so it stays in its group), reading nothing it keeps (`fetch_plan`);
- which records of the shared queue topic are this queue's (by key), which offsets go into the
  Start transaction (this batch's and those of other queues' records read before it, in
  partitions it still holds), and where to read again when the transaction fails or records were
  read while paused;
- when the offsets of other queues' records are committed on their own;
- which messages need a KeepAlive marker now;
- what ack, retry, abandon and release do to a message, and the marker each sends.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from outbox.queue import markers
from outbox.queue.config import QueueLimits
from outbox.queue.errors import QueueError
from outbox.queue.markers import Kind, Marker, Ref

#: Held full this long (slow handlers), the consumer pauses its partitions and polls to stay in its group.
FULL_PAUSE_AFTER = 5.0
#: Offsets of records of other queues are committed at least this often (seconds) ...
FOREIGN_COMMIT_INTERVAL = 1.0
#: ... or after this many such records.
FOREIGN_COMMIT_RECORDS = 1000


class Held(enum.Enum):
    BUFFERED = "buffered"  # started, waiting for receive()
    RECEIVED = "received"  # in the application's hands
    DONE = "done"  # settled (acked, retried, abandoned) or released


@dataclass(slots=True, eq=False)
class Delivery:
    """One delivery of a message, from the record read to its settling."""

    ref: Ref
    id: str
    key: bytes | None
    payload: bytes
    raw_headers: list[tuple[str, bytes | None]]
    deliveries: int
    #: Local time it was read; then the time receive() handed it out.
    received_at: float
    last_marker: float
    #: The markers partition its Start marker went to: its later markers follow it there.
    marker_partition: int | None = None
    state: Held = Held.BUFFERED


class Plan(enum.Enum):
    READ = "read"  # poll for records (resuming the partitions first if they were paused)
    WAIT = "wait"  # full: wait for a message to be settled
    PAUSE = "pause"  # full for long: pause the partitions, then drain as DRAIN does
    DRAIN = "drain"  # paused: poll to stay in the group, and read again later whatever came


@dataclass(frozen=True, slots=True)
class FetchPlan:
    plan: Plan
    #: READ: at most this many records (never more of this queue than there is room for).
    room: int = 0
    #: READ: the partitions were paused and must be resumed first.
    resume: bool = False


@dataclass(slots=True)
class StartBatch:
    """This queue's records of one poll: their Start markers and the offsets go in one transaction."""

    deliveries: list[Delivery]
    #: partition -> next offset to read: committed with the Start markers.
    offsets: dict[int, int]
    #: partition -> first offset read: where to read again if the transaction fails.
    rewind: dict[int, int]


class ConsumerState:
    """The held messages of one logical queue and the consumer's bookkeeping of the queue topic."""

    def __init__(self, queue: str, limits: QueueLimits, now: float) -> None:
        self.queue, self.limits = queue, limits
        self._key = queue.encode()
        self._key_prefix = self._key + b"/"
        #: Messages held: buffered or received, not yet settled.
        self.held: dict[Ref, Delivery] = {}
        self._buffered: deque[Delivery] = deque()
        self.paused = False
        self._full_since: float | None = None
        #: Offsets past records of other queues, not yet committed.
        self._pending: dict[int, int] = {}
        self._pending_records = 0
        self._last_foreign_commit = now
        #: Totals since start, for status rows and tests.
        self.received = self.acked = self.retried = self.abandoned = self.released = self.started = 0

    # -- reading ----------------------------------------------------------------------------------

    @property
    def room(self) -> int:
        return self.limits.max_in_progress - len(self.held)

    def fetch_plan(self, now: float) -> FetchPlan:
        """What the fetcher does next, by back-pressure."""
        room = self.room
        if room > 0:
            self._full_since = None
            resume, self.paused = self.paused, False
            return FetchPlan(Plan.READ, room, resume)
        if self._full_since is None:
            self._full_since = now
        if self.paused:
            return FetchPlan(Plan.DRAIN)
        if now - self._full_since < FULL_PAUSE_AFTER:
            return FetchPlan(Plan.WAIT)
        self.paused = True
        return FetchPlan(Plan.PAUSE)

    def is_ours(self, key: bytes | None) -> bool:
        """Records keyed by the queue's name, or "name/message-id" (stashed through the outbox)."""
        return key == self._key or (key is not None and key.startswith(self._key_prefix))

    def read(self, records: Iterable[Any], now: float) -> StartBatch | None:
        """Records of one poll (errors already taken out): this queue's to start, the others' skipped."""
        ours: list[Delivery] = []
        positions: dict[int, int] = {}
        first: dict[int, int] = {}
        count = 0
        for record in records:
            count += 1
            partition, offset = record.partition(), record.offset()
            first.setdefault(partition, offset)
            positions[partition] = offset + 1
            if self.is_ours(record.key()):
                ours.append(self._delivery(record, now))
        if ours:
            return StartBatch(ours, {**self._pending, **positions}, first)
        self._pending.update(positions)
        self._pending_records += count
        return None

    def batch_started(self, batch: StartBatch, partitions: dict[Ref, int], now: float) -> None:
        """The batch's transaction committed: its messages are held and buffered for receive()."""
        self._pending.clear()
        self._pending_records = 0
        self.started += len(batch.deliveries)
        for delivery in batch.deliveries:
            # Later markers go to the partition its Start went to, even if the markers topic
            # gains partitions meanwhile.
            delivery.marker_partition = partitions.get(delivery.ref)
            delivery.last_marker = now
            self.held[delivery.ref] = delivery
            self._buffered.append(delivery)

    @staticmethod
    def rewind(records: Iterable[Any]) -> dict[int, int]:
        """Records read while paused: partition -> first offset, to read again once there is room."""
        first: dict[int, int] = {}
        for record in records:
            first.setdefault(record.partition(), record.offset())
        return first

    def revoked(self, partitions: Iterable[int]) -> None:
        """Partitions taken away (revoked, or lost with the group's session): their offsets are their
        new owner's to commit. Committed later, with a valid generation, they would move the group's
        offset back, and the new owner would read and start messages acked already."""
        for partition in partitions:
            self._pending.pop(partition, None)

    def foreign_offsets(self, now: float, force: bool = False) -> dict[int, int] | None:
        """Offsets past other queues' records to commit now (now and then, so a restart skips them), or None."""
        if not self._pending:
            return None
        if not force and self._pending_records < FOREIGN_COMMIT_RECORDS \
                and now - self._last_foreign_commit < FOREIGN_COMMIT_INTERVAL:
            return None
        offsets = dict(self._pending)
        self._pending.clear()
        self._pending_records = 0
        self._last_foreign_commit = now
        return offsets

    def start_marker(self, delivery: Delivery) -> Marker:
        headers = markers.message_headers(delivery.raw_headers, message_id=delivery.id,
                                          deliveries=delivery.deliveries)
        return Marker(Kind.START, delivery.ref, self.limits.redelivery_timeout, key=delivery.key,
                      payload=delivery.payload, headers=tuple(headers), max_deliveries=self.limits.max_deliveries)

    # -- handing out and settling -----------------------------------------------------------------

    def take(self, now: float) -> Delivery | None:
        """The oldest buffered message, now received; None if there is none."""
        while self._buffered:
            delivery = self._buffered.popleft()
            if delivery.state is Held.BUFFERED:  # else released by close() meanwhile
                delivery.state = Held.RECEIVED
                delivery.received_at = now
                self.received += 1
                return delivery
        return None

    @property
    def buffered(self) -> int:
        return sum(1 for d in self._buffered if d.state is Held.BUFFERED)

    def settle(self, delivery: Delivery, kind: Kind | None, delay: float = 0.0) -> Marker | None:
        """ack (END), retry (KEEPALIVE with `delay`) or abandon (None): the marker to send, if any.

        Settling twice does nothing (None); the marker must be sent before any later keep-alive
        could be, so the caller sends it under the same lock.
        """
        if delivery.state is not Held.RECEIVED:
            if delivery.state is Held.BUFFERED:
                raise QueueError("a message must be received before it is acknowledged")
            return None  # acked, retried or abandoned already; or released by close()
        delivery.state = Held.DONE
        del self.held[delivery.ref]
        if kind is Kind.END:
            self.acked += 1
            return Marker(Kind.END, delivery.ref)
        if kind is Kind.KEEPALIVE:
            self.retried += 1
            return Marker(Kind.KEEPALIVE, delivery.ref, delay)
        self.abandoned += 1
        return None

    def keep_alives(self, now: float) -> list[tuple[Delivery, Marker]]:
        """A KeepAlive for every held message whose last marker is keep_alive_interval old."""
        interval = self.limits.keep_alive_interval
        assert interval is not None
        due = []
        for delivery in self.held.values():
            if now - delivery.last_marker >= interval:
                delivery.last_marker = now
                due.append((delivery, Marker(Kind.KEEPALIVE, delivery.ref, self.limits.redelivery_timeout)))
        return due

    def release_buffered(self) -> list[tuple[Delivery, Marker]]:
        """Closing: messages never received go back (Release markers: redelivered at once, no delivery counted)."""
        released = []
        for delivery in list(self.held.values()):
            if delivery.state is Held.BUFFERED:
                delivery.state = Held.DONE
                del self.held[delivery.ref]
                self.released += 1
                released.append((delivery, Marker(Kind.RELEASE, delivery.ref)))
        self._buffered.clear()
        return released

    def drop_held(self) -> list[Delivery]:
        """Closing after the timeout: what is still held is left to the redelivery timeout."""
        left = list(self.held.values())
        for delivery in left:
            delivery.state = Held.DONE
        self.held.clear()
        return left

    def oldest_received(self) -> float | None:
        """Local time the oldest held message was received (or read, if still buffered)."""
        return min((d.received_at for d in self.held.values()), default=None)

    def _delivery(self, record: Any, now: float) -> Delivery:
        raw_headers = record.headers() or []
        ref = (record.partition(), record.offset())
        return Delivery(ref, markers.header_text(raw_headers, markers.ID_HEADER) or markers.ref_id(ref), record.key(),
                        record.value() or b"", raw_headers, markers.deliveries_of(raw_headers), now, now)
