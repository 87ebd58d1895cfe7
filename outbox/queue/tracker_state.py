"""What a redelivery tracker knows about one partition of the markers topic, rebuilt from the log.

Pure state, no I/O: feed it markers with their offsets and timestamps, and ask it what is due
for redelivery and which offset is safe to commit. Times are seconds: `timestamp` is the
marker's (the broker's append time when the topic uses LogAppendTime), `now` the tracker's
local monotonic clock.

As in kafka-mq-go, three structures per partition:
- in_progress: message (its partition and offset in the queue topic) -> the Start marker's data;
- by offset: a heap of Start marker offsets. Its head is the smallest offset still needed, so
  committing it means a restarted tracker replays every marker of every message in progress;
- by deadline: a heap of redelivery deadlines (marker timestamp + redeliver-after).
Heap entries are never updated in place: a newer entry supersedes an older one (the version)
and stale entries are dropped when they reach the head.

The tracker is caught up when it has read everything the partition holds: its consumer's
position has reached the high watermark librdkafka last fetched (`read_to`, every round). Under
steady traffic that is most rounds (librdkafka's end-of-partition event then never comes: it
needs a fetch that waited fetch.wait.max.ms for nothing); after a transaction's last marker its
control record keeps the position one short until the partition is quiet and that event moves
it on. And never while a transaction is left open (a consumer or tracker died inside it): a
read_committed consumer gets nothing past its first record, KeepAlives and End markers written
after it included, until the broker aborts it (transaction.timeout.ms).

The deadline clock is the timestamp of the last marker read. When the partition is caught up
and quiet, it advances with the local monotonic clock from the moment that marker was read;
while the tracker is behind (replaying after a restart, stopped by an open transaction, or
reading a busy partition), it does not, so a message whose End marker or KeepAlive is still
unread is never redelivered just because reading takes time: a deadline passes only by the
timestamps of markers read, and a marker hidden past them was written after them.
(kafka-mq-go extrapolates after a fixed quiet period instead.)

And nothing is handed out for redelivery until the partition is rebuilt: read up to the high
watermark first known after it was assigned. The previous owner's redeliveries end with End
markers before that point; a deadline passed by the markers read so far proves nothing about
them, and handing out before reading them redelivers the same delivery twice. Behind an open
transaction, rebuilding waits for the broker to abort it. (Once rebuilt, no other tracker can
write an End marker in the partition: the group's generation fences them.)
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from outbox.queue.markers import Kind, Marker, Ref


@dataclass(slots=True)
class InProgress:
    """A message some consumer started and nobody has ended yet."""

    queue: str
    start: Marker
    marker_offset: int
    started: float
    deadline: float
    version: int
    #: Handed back unprocessed (a Release marker): redelivered without counting a delivery.
    released: bool = False
    #: Handed out for redelivery; stays in progress (and pins the committed offset) until its End marker is read.
    due: bool = False


@dataclass(frozen=True, slots=True)
class Due:
    """A message whose deadline passed: redeliver it, or dead-letter it when it reached its max deliveries."""

    partition: int
    queue: str
    start: Marker
    dead: bool
    #: The delivery count the redelivered record carries.
    next_deliveries: int


@dataclass(slots=True)
class QueueStats:
    in_progress: int = 0
    #: Timestamp of the oldest Start marker in progress (seconds since the epoch, the broker's clock).
    oldest_started: float | None = None


@dataclass
class PartitionTracker:
    partition: int
    in_progress: dict[Ref, InProgress] = field(default_factory=dict)
    _by_offset: list[tuple[int, Ref]] = field(default_factory=list)
    _by_deadline: list[tuple[float, int, Ref]] = field(default_factory=list)
    _version: int = 0
    _next_offset: int | None = None
    _last_timestamp: float | None = None
    _seen_at: float = 0.0
    _caught_up: bool = False
    _rebuild_to: int | None = None
    _rebuilt: bool = False
    _end_reached: int = -1  # the offset of the last end-of-partition event (-1: none yet)
    _clock_floor: float = -math.inf

    def apply(self, queue: str, marker: Marker, offset: int, timestamp: float, now: float) -> None:
        """One marker read at `offset` with `timestamp`, seen at local time `now`."""
        entry = self.in_progress.get(marker.ref)
        if marker.kind is Kind.START:
            if entry is None:
                entry = InProgress(queue, marker, offset, timestamp, 0.0, 0)
                self.in_progress[marker.ref] = entry
                heapq.heappush(self._by_offset, (offset, marker.ref))
                self._arm(entry, timestamp + marker.redeliver_after)
            elif not entry.due:
                # A second Start for the same record (a consumer retried after an unclear commit):
                # take its deadline, keep the first marker's offset (markers after it may matter).
                self._arm(entry, timestamp + marker.redeliver_after)
        elif marker.kind is Kind.KEEPALIVE:
            # A keep-alive for a message not in progress is a straggler (sent as the End marker
            # was) or arrived after a redelivery was decided: it must not bring the message back.
            if entry is not None and not entry.due:
                self._arm(entry, timestamp + marker.redeliver_after)
        elif marker.kind is Kind.RELEASE:
            if entry is not None and not entry.due:
                entry.released = True
                self._arm(entry, timestamp)
        else:  # END: removed here; its heap entries are dropped when they reach a head
            self.in_progress.pop(marker.ref, None)
        self.advance(offset, timestamp, now)

    def advance(self, offset: int, timestamp: float, now: float) -> None:
        """A record at `offset` was read (a marker, or something else to skip): the offset and clock move on."""
        self._next_offset = offset + 1
        if self._last_timestamp is None or timestamp > self._last_timestamp:
            self._last_timestamp = timestamp
        self._seen_at = now
        self._caught_up = False

    def reached_end(self, offset: int) -> None:
        """The consumer said it reached the partition's end at `offset` (an end-of-partition event). librdkafka's
        position() stays unknown until the consumer has handed out a record of the partition, so a partition with
        nothing left to read where it was assigned (empty, or committed at its end) would never count as read."""
        self._end_reached = max(self._end_reached, offset)

    def read_to(self, position: int | None, high_watermark: int | None) -> None:
        """Every round, after the markers read: the consumer's position (the offset it returns next)
        and the partition's high watermark as last fetched; None when not known (not caught up)."""
        if self._end_reached >= 0:
            position = self._end_reached if position is None else max(position, self._end_reached)
        if position is None or high_watermark is None or high_watermark < 0:
            self._caught_up = False
            return
        if self._rebuild_to is None:
            self._rebuild_to = high_watermark
        self._caught_up = position >= high_watermark
        self._rebuilt = self._rebuilt or position >= self._rebuild_to

    @property
    def caught_up(self) -> bool:
        """Everything the partition holds has been read (as of the last round)."""
        return self._caught_up

    @property
    def rebuilt(self) -> bool:
        """Read up to the high watermark first known after the partition was assigned: the state is whole."""
        return self._rebuilt

    def logical_now(self, now: float) -> float | None:
        """The deadline clock: None until a marker was read."""
        if self._last_timestamp is None:
            return None
        t = self._last_timestamp + (now - self._seen_at if self._caught_up else 0.0)
        self._clock_floor = max(self._clock_floor, t)
        return self._clock_floor

    def due(self, now: float) -> list[Due]:
        """Messages whose deadline has passed, each handed out once; they stay in progress until ended.

        Nothing before the partition is rebuilt: a message whose deadline passed by the markers
        read so far may have been redelivered by the previous owner already, its End marker not
        read yet (or hidden behind an open transaction).
        """
        t = self.logical_now(now)
        found: list[Due] = []
        if t is None or not self._rebuilt:
            return found
        heap = self._by_deadline
        while heap and heap[0][0] <= t:
            _, version, ref = heapq.heappop(heap)
            entry = self.in_progress.get(ref)
            if entry is None or entry.version != version or entry.due:
                continue
            entry.due = True
            start = entry.start
            limit = start.max_deliveries
            dead = not entry.released and limit is not None and start.deliveries >= limit
            found.append(Due(self.partition, entry.queue, start, dead,
                             start.deliveries + (0 if entry.released else 1)))
        return found

    def postpone(self, ref: Ref, delay: float, now: float) -> None:
        """A redelivery that failed: try again `delay` seconds later on the deadline clock."""
        entry = self.in_progress.get(ref)
        if entry is not None and entry.due:
            entry.due = False
            self._arm(entry, (self.logical_now(now) or 0.0) + delay)

    def commit_offset(self) -> int | None:
        """The offset a restarted tracker must read from: the oldest Start still in progress, else the next marker."""
        heap = self._by_offset
        while heap:
            offset, ref = heap[0]
            entry = self.in_progress.get(ref)
            if entry is not None and entry.marker_offset == offset:
                return offset
            heapq.heappop(heap)
        return self._next_offset

    def stats(self) -> dict[str, QueueStats]:
        """In progress per queue, with the oldest Start's timestamp."""
        found: dict[str, QueueStats] = {}
        for entry in list(self.in_progress.values()):
            stats = found.setdefault(entry.queue, QueueStats())
            stats.in_progress += 1
            if stats.oldest_started is None or entry.started < stats.oldest_started:
                stats.oldest_started = entry.started
        return found

    def _arm(self, entry: InProgress, deadline: float) -> None:
        self._version += 1
        entry.version, entry.deadline = self._version, deadline
        heapq.heappush(self._by_deadline, (deadline, self._version, entry.start.ref))
