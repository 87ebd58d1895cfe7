"""What a share-group consumer decides, with no I/O: the share backend's counterpart of consumer_state.py.

Kafka's share groups (KIP-932) lock each record for one consumer, count its deliveries and
redeliver what a dead consumer held; what is left to us is what Kafka cannot know:

- a record delivered more than max_deliveries times (its consumer died on the last one) goes to
  the dead letters without running the handler;
- a handler that failed, or asked to Retry, on the last allowed delivery: dead letter;
- the dead letter is written *before* the record is REJECTed (archived by Kafka), so nothing is
  archived unseen; if it cannot be written, it is tried again while the record's lock holds, and only
  then is the record RELEASEd to come back (each RELEASE spends one of the deliveries left before
  the broker's own limit archives the record unseen);
- Retry(delay): the record is held, then RELEASEd once the delay has passed (Kafka has no delayed
  release); never held past its lock, which would redeliver it anyway.

The explicit acknowledgement mode of the client hands out a batch per poll and takes no other poll
until every record of the batch is acknowledged: ShareState says when the batch is done.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from outbox.queue.config import QueueLimits
from outbox.queue.consumer_state import Delivery, Held

Ref = tuple[int, int]
#: A delayed release is sent this long before the lock would expire (the acknowledgement must arrive first).
LOCK_MARGIN = 0.5
#: A dead letter that could not be written is tried again this often while its record's lock holds.
LETTER_RETRY = 0.5


class Ack(enum.Enum):
    """The acknowledgement types of KIP-932 that this client offers."""

    ACCEPT = "accept"
    RELEASE = "release"
    REJECT = "reject"


class Outcome(enum.Enum):
    """What the application did with a delivery."""

    ACKED = "acked"
    RETRIED = "retried"
    ABANDONED = "abandoned"
    RELEASED = "released"  # never handed out (close)


@dataclass(frozen=True, slots=True)
class Verdict:
    """How to settle one delivery: the acknowledgement, whether a dead letter comes first, and when."""

    ack: Ack
    dead_letter: bool = False
    #: Local time at which to send it (a Retry's delay); None: now. (Not 0.0 for now: a monotonic clock's
    #: reference point is undefined, and a clock below 0 would hold every acknowledgement back until it passed 0.)
    at: float | None = None


def dead_on_arrival(deliveries: int, limits: QueueLimits) -> bool:
    """A record delivered more often than allowed (its consumer died while handling the last): a dead letter."""
    return limits.max_deliveries is not None and deliveries > limits.max_deliveries


def verdict(outcome: Outcome, deliveries: int, limits: QueueLimits, *, now: float, locked_at: float,
            delay: float = 0.0) -> Verdict:
    """How to settle a delivery after `outcome` (pure: the simulator and the unit tests call it)."""
    if outcome is Outcome.ACKED:
        return Verdict(Ack.ACCEPT)
    if outcome is Outcome.RELEASED:
        return Verdict(Ack.RELEASE)
    last = limits.max_deliveries is not None and deliveries >= limits.max_deliveries
    if last:
        return Verdict(Ack.REJECT, dead_letter=True)
    if outcome is Outcome.RETRIED and delay > 0:
        lock_ends = locked_at + limits.redelivery_timeout - LOCK_MARGIN
        return Verdict(Ack.RELEASE, at=min(now + delay, lock_ends))
    return Verdict(Ack.RELEASE)


def group_settings(limits: QueueLimits) -> dict[str, str]:
    """The share group's configuration: from the earliest offset (nothing sent before the first consumer
    is lost; Kafka's default is the latest) and the lock duration from redelivery_timeout."""
    return {"share.auto.offset.reset": "earliest",
            "share.record.lock.duration.ms": str(round(limits.redelivery_timeout * 1000))}


@dataclass(slots=True)
class Settling:
    """A decided acknowledgement waiting to be sent by the I/O thread."""

    delivery: Delivery
    verdict: Verdict


@dataclass
class ShareState:
    """The deliveries of the current batch: buffered, handed out, settled; and what is due to be sent."""

    queue: str
    limits: QueueLimits
    held: dict[Ref, Delivery] = field(default_factory=dict)
    buffered: deque[Delivery] = field(default_factory=deque)
    #: Verdicts due now, in the order decided.
    due: list[Settling] = field(default_factory=list)
    #: Delayed releases: (time, sequence, settling).
    later: list[tuple[float, int, Settling]] = field(default_factory=list)
    received: int = 0
    acked: int = 0
    retried: int = 0
    abandoned: int = 0
    released: int = 0
    dead_lettered: int = 0
    redelivered: int = 0
    _sequence: int = 0

    def arrived(self, deliveries: Iterable[Delivery]) -> list[Delivery]:
        """A polled batch: buffered for receive(), except the dead on arrival (returned, already due)."""
        dead = []
        for delivery in deliveries:
            self.held[delivery.ref] = delivery
            if delivery.deliveries > 1:
                self.redelivered += 1
            if dead_on_arrival(delivery.deliveries, self.limits):
                delivery.state = Held.DONE
                self.due.append(Settling(delivery, Verdict(Ack.REJECT, dead_letter=True)))
                dead.append(delivery)
            else:
                self.buffered.append(delivery)
        return dead

    def take(self, now: float) -> Delivery | None:
        """The next buffered delivery for the application, or None."""
        self.expire_buffered(now)
        if not self.buffered:
            return None
        delivery = self.buffered.popleft()
        delivery.state = Held.RECEIVED
        delivery.received_at = now
        self.received += 1
        return delivery

    def settle(self, delivery: Delivery, outcome: Outcome, now: float, delay: float = 0.0) -> Verdict | None:
        """The application settled `delivery`; None if it was settled before (a second ack does nothing)."""
        if delivery.state is Held.DONE or delivery.ref not in self.held:
            return None
        delivery.state = Held.DONE
        decided = verdict(outcome, delivery.deliveries, self.limits, now=now, locked_at=delivery.last_marker,
                          delay=delay)
        counter = {Outcome.ACKED: "acked", Outcome.RETRIED: "retried", Outcome.ABANDONED: "abandoned",
                   Outcome.RELEASED: "released"}[outcome]
        setattr(self, counter, getattr(self, counter) + 1)
        settling = Settling(delivery, decided)
        if decided.at is not None and decided.at > now:
            self._sequence += 1
            heapq.heappush(self.later, (decided.at, self._sequence, settling))
        else:
            self.due.append(settling)
        return decided

    def release_buffered(self, now: float) -> int:
        """Close: the deliveries never handed out go back at once."""
        count = 0
        while self.buffered:
            delivery = self.buffered.popleft()
            self.settle(delivery, Outcome.RELEASED, now)
            count += 1
        return count

    def expire_buffered(self, now: float) -> int:
        """Buffered deliveries whose lock is about to expire go back now (RELEASE), never handed out late.

        librdkafka's max.poll.records is a soft limit: a poll may bring more than max_in_progress records,
        all locked from the fetch on (`last_marker`, the fetch time here), and slow handlers may not reach
        the last ones within the lock."""
        count = 0
        while self.buffered and self.buffered[0].last_marker + self.limits.redelivery_timeout - LOCK_MARGIN <= now:
            self.settle(self.buffered.popleft(), Outcome.RELEASED, now)
            count += 1
        return count

    def take_due(self, now: float) -> list[Settling]:
        """What the I/O thread must send now (delayed releases whose time came included)."""
        self.expire_buffered(now)
        while self.later and self.later[0][0] <= now:
            self.due.append(heapq.heappop(self.later)[2])
        due, self.due = self.due, []
        return due

    def letters_failed(self, settlings: list[Settling], now: float) -> list[Settling]:
        """Dead letters that could not be written: tried again in LETTER_RETRY while the lock holds (a RELEASE
        would spend a delivery, and past the broker's delivery limit Kafka archives the record unseen). Returns
        the RELEASEs to send now, for records whose lock ends before the next try."""
        release = []
        for settling in settlings:
            lock_ends = settling.delivery.last_marker + self.limits.redelivery_timeout - LOCK_MARGIN
            if now + LETTER_RETRY < lock_ends:
                self._sequence += 1
                heapq.heappush(self.later, (now + LETTER_RETRY, self._sequence, settling))
            else:
                release.append(Settling(settling.delivery, Verdict(Ack.RELEASE)))
        return release

    def client_replaced(self) -> int:
        """A new client took over from one that failed for good: the buffered deliveries were the old one's
        (Kafka hands them out again when their locks end), so they are dropped; returns how many."""
        count = len(self.buffered)
        for delivery in self.buffered:
            delivery.state = Held.DONE
            self.held.pop(delivery.ref, None)
        self.buffered.clear()
        return count

    def sent(self, settling: Settling, *, dead_lettered: bool = False) -> None:
        """The acknowledgement is with the client (`dead_lettered`: after its dead letter was written)."""
        self.held.pop(settling.delivery.ref, None)
        if dead_lettered:
            self.dead_lettered += 1

    def next_due(self) -> float | None:
        """When something is due next without the application: a delayed release or a buffered lock's end."""
        times = [self.later[0][0]] if self.later else []
        if self.buffered:
            times.append(self.buffered[0].last_marker + self.limits.redelivery_timeout - LOCK_MARGIN)
        return min(times) if times else None

    @property
    def batch_done(self) -> bool:
        """Every record of the last poll acknowledged: the client takes another poll."""
        return not self.held

    def oldest_received(self) -> float | None:
        times = [d.received_at for d in self.held.values() if d.state is Held.RECEIVED]
        return min(times) if times else None
