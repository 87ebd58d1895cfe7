"""The core's records: per-key lanes, sending within the throttle, and what settling them frees (the purge and
reset batches themselves: settling.py).

A marked record waits in its key's lane, in id order. At most `max_in_flight_per_key` records of a
key are in flight (1 is goharvest's barrier) and `max_in_flight_records` in all (the throttle). A
key's slot is freed only when the purge of its acknowledged record has committed: freeing it on
the ack alone lets a crash replay R0 R1 after R1. A key's acknowledged records are purged in its
order, never one while an earlier one of its key is unsettled. A failed delivery resets the row
and forces a re-mark under a new leader id (Leadership.remark), so the failed record goes out again
before anything marked after it.

A key's first record to a topic goes alone (until one of the key's records to that topic is
acknowledged on this producer; a new producer starts again): a partition that holds nothing yet from
a producer accepts that producer's first batch whatever its sequence number, so if the batch before
it failed for a moment (the partition's leader not ready, as just after the topic was created) the
later one is written first and the earlier one's retry is answered as a duplicate (acks.py). Only
records of other keys can be written ahead of it that way; the key's own next record waits for its ack.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from outbox.harvest import commands as cmd
from outbox.harvest.commands import DeliveryError
from outbox.harvest.contract import Record
from outbox.harvest.settling import Settling

if TYPE_CHECKING:
    from outbox.harvest.core import Core

log = logging.getLogger("outbox.harvest")

#: Records of a held key kept in memory behind the held one; beyond it they stay marked in the
#: table, and releasing the key re-marks them under a new leader id.
HELD_BACKLOG = 1000


class EntryState(enum.Enum):
    QUEUED = "queued"  # marked, waiting in its lane
    SENT = "sent"  # handed to the producer
    ACKED = "acked"  # acknowledged by Kafka; purge pending or under way
    FAILED = "failed"  # delivery failed; reset pending or under way
    HELD = "held"  # poison: stays marked, its key waits


@dataclass(slots=True, eq=False)
class Entry:
    """A record the core tracks, from mark to purge (or reset, hold, park)."""

    record: Record
    marked_at: float
    state: EntryState = EntryState.QUEUED
    sent_at: float = 0.0
    error: DeliveryError | None = None
    #: Must be sent with nothing else in flight (it failed among others with a permanent error).
    solo: bool = False
    #: In a Purge (to come, or under way).
    purging: bool = False
    #: Went out with nothing else in flight (so a permanent failure can only be its own).
    sent_alone: bool = False
    #: Known poison, re-marked behind earlier records of its key: held again, unsent, once it is first.
    rehold: bool = False


@dataclass(slots=True, eq=False)
class Lane:
    """One key's records: queued (unsent, id order) and unsettled (sent, acked or failed, send order)."""

    key: str
    queued: deque[Entry] = field(default_factory=deque)
    unsettled: list[Entry] = field(default_factory=list)
    #: The key's held (poison) record; its later records wait in `queued`.
    held: Entry | None = None
    #: The held record is being sent again (it changed, or its retry time came).
    retrying: bool = False
    #: The held record's version is known (its Hold committed): checks compare against it.
    version_known: bool = False
    #: Holds of its record so far: a check asked before the latest one cannot judge its version.
    holds: int = 0
    #: Records of this key were dropped from memory while it was held (they stay marked).
    overflowed: bool = False
    #: One record at a time until one goes through (after a failure of this key).
    single: bool = False
    #: Topics a record of this key was acknowledged in on the current producer: the first record to any
    #: other goes alone (module docstring).
    acked_topics: set[str] = field(default_factory=set)
    #: Listed in the ready queue.
    ready: bool = False
    #: How many of `unsettled`, from the front, are acknowledged and queued for purging.
    purge_queued: int = 0

    @property
    def waiting(self) -> bool:
        """Its queued records are behind a held record (not counted as queued, never timed out)."""
        return self.held is not None

    def hold(self, entry: Entry) -> None:
        """The key waits behind `entry`, known poison: it stays marked, unsent."""
        entry.state = EntryState.HELD
        entry.solo = False
        self.holds += 1
        self.held = entry
        self.retrying = False
        self.version_known = True
        self.ready = False

    def retry(self, record: Record) -> None:
        """The held record goes out again, alone and first, as `record` (its row as it is now)."""
        entry = self.held
        entry.record = record
        entry.state = EntryState.QUEUED
        entry.solo = True
        self.retrying = True
        self.queued.appendleft(entry)

    def abandon(self) -> list[int]:
        """Drop what is not sent (it stays marked); returns the ids dropped."""
        dropped = [entry.record.id for entry in self.queued]
        self.queued.clear()
        if self.held is not None:
            if self.held.state is EntryState.HELD:
                dropped.append(self.held.record.id)
            self.held = None
        self.retrying = self.overflowed = self.ready = False
        return dropped

    def acked_prefix(self) -> list[Entry]:
        """The acknowledged records from the first not yet queued for purging up to the first unsettled one, now
        queued for purging: a key's records are purged in its order."""
        start = index = self.purge_queued
        while index < len(self.unsettled) and self.unsettled[index].state is EntryState.ACKED:
            self.unsettled[index].purging = True
            index += 1
        self.purge_queued = index
        return self.unsettled[start:index]

    def forget(self, entry: Entry) -> None:
        """An unsettled record leaves the lane (settled, or never sent after all)."""
        if self.unsettled[0] is entry:
            del self.unsettled[0]
        else:
            self.unsettled.remove(entry)


class Judged(enum.Enum):
    PUBLISHED = "published"  # sent alone (a suspect, or a held record retried) and acknowledged: not poison
    SUSPECT = "suspect"  # failed with a permanent error among others: to be sent alone
    FAILED_ALONE = "failed alone"  # failed on its own with a permanent error: poison, no longer a suspect
    REFUSED = "refused"  # refused by the producer with a permanent error (it never left): poison


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a delivery report or a refusal says of a record for the poison book (Core hands it over)."""

    judged: Judged
    lane: Lane
    entry: Entry
    reason: str = ""


class Lanes:
    """Every record the core tracks, by key; what is sent and settled. The poison book (poison.py) decides which keys
    are held and places their records in the lane it is handed; Lanes reports what deliveries say (Verdict) and
    keeps its books (counts, entries, the ready queue) as Core tells it to hold, retry or release a held record."""

    #: The purge and reset batches' class (a mutation in the simulator swaps it).
    settling_class: type[Settling] = Settling

    def __init__(self, core: Core) -> None:
        self.core = core
        self.limits = core.limits
        now = core.now
        self.entries: dict[int, Entry] = {}
        self.lanes: dict[str, Lane] = {}
        self.busy: dict[str, None] = {}  # keys with records in flight, oldest first (for snapshots)
        self.ready: deque[Lane] = deque()
        self.queued = 0  # queued records not waiting behind a held one
        self.in_flight = 0  # sent and not yet settled (purged or reset)
        self._sent: deque[Entry] = deque()  # in send order, for the delivery timeout
        self.solo: Entry | None = None
        self._paused_until = now  # the producer's queue was full
        self._next_queue_check = now
        self.aborted = False  # AbortSends issued; nothing more is sent until all in flight settled
        self.restarting = False  # RestartProducer issued, not yet answered
        #: Acknowledged records to purge and failed ones to reset, in batches.
        self.settling = self.settling_class(self.limits, now)
        #: The last dispatch left something waiting for a record to settle (a key's slots, the throttle,
        #: a solo record): purges then go every purge_interval, not after purge_delay.
        self.settle_wanted = True
        #: Keys with records queued behind their full slots: they wait for a purge.
        self._blocked: set[str] = set()

    # -- time -----------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        sent = self._sent
        while sent and sent[0].state is not EntryState.SENT:
            sent.popleft()
        if sent and not self.aborted and now >= sent[0].sent_at + self.limits.delivery_timeout:
            self.abort(f"a record was not acknowledged within {self.limits.delivery_timeout:g}s")

    def queue_timed_out(self, now: float) -> bool:
        """A marked record waited more than queue_timeout to be sent (checked a few times per timeout)."""
        if not self.queued or now < self._next_queue_check:
            return False
        # Scanning the lanes costs O(keys): look a few times per timeout, not every tick.
        self._next_queue_check = now + min(1.0, self.limits.queue_timeout / 4)
        oldest = now
        for lane in self.lanes.values():
            if lane.queued and not lane.waiting:
                oldest = min(oldest, lane.queued[0].marked_at)
        return now - oldest > self.limits.queue_timeout

    def deadline(self, deadline: float, active: bool) -> float:
        if active and self.ready and self._paused_until > self.core.now:
            deadline = min(deadline, self._paused_until)
        deadline = self.settling.deadline(deadline, active, self.settle_wanted)
        if self._sent and not self.aborted:
            deadline = min(deadline, self._sent[0].sent_at + self.limits.delivery_timeout)
        return deadline

    # -- the producer -----------------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Give up every record in flight: the shell drops them from the producer and reports each failed."""
        if not self.aborted and self.in_flight:
            self.aborted = True
            log.warning("Giving up %d record(s) in flight: %s", self.in_flight, reason)
            self.core.command(cmd.AbortSends(reason))

    def producer_replaced(self) -> None:
        """A new producer: every key's next record to a topic goes alone until one is acknowledged there
        (module docstring)."""
        for lane in self.lanes.values():
            lane.acked_topics.clear()

    def restart_producer(self) -> None:
        if not self.restarting:
            self.restarting = True
            self.core.command(cmd.RestartProducer())

    def delivered(self, record_id: int, error: DeliveryError | None) -> Verdict | None:
        entry = self._sent_entry(record_id)
        if entry is None:
            return None
        self._paused_until = self.core.now
        if error is not None:
            return self._failed(entry, error)
        entry.state = EntryState.ACKED
        lane = self.lanes[entry.record.key]
        topic = entry.record.topic
        if lane.single or topic not in lane.acked_topics:
            lane.single = False
            lane.acked_topics.add(topic)
            if lane.queued:  # its next records may go together now: no need to wait for the purge
                self._blocked.discard(lane.key)
                self.make_ready(lane)
        self._purge_prefix(lane)
        if entry is self.solo:
            self.solo = None
            return Verdict(Judged.PUBLISHED, lane, entry)
        return None

    def _sent_entry(self, record_id: int) -> Entry | None:
        """The record's entry if it is in flight (a report of anything else is stale)."""
        entry = self.entries.get(record_id)
        return entry if entry is not None and entry.state is EntryState.SENT else None

    def refused(self, record_id: int, error: DeliveryError) -> Verdict | None:
        entry = self._sent_entry(record_id)
        if entry is None:
            return None
        if not error.permanent:
            return self._failed(entry, error)
        # It never left: it is guilty on its own, and nothing needs resetting.
        self.unsend(entry)
        if entry is self.solo:
            self.solo = None
        return Verdict(Judged.REFUSED, self.lanes[entry.record.key], entry, str(error))

    def backpressure(self, record_ids: Iterable[int]) -> None:
        for record_id in reversed(list(record_ids)):
            entry = self._sent_entry(record_id)
            if entry is None:
                continue
            self.unsend(entry)
            lane = self.lanes[entry.record.key]
            lane.queued.appendleft(entry)
            if not lane.waiting:
                self.queued += 1
            self.make_ready(lane, first=True)
        self._paused_until = self.core.now + min(self.limits.io_error_backoff, 0.05)

    # -- taking marked records in ---------------------------------------------------------------

    def admit(self, record: Record, suspected: bool) -> tuple[Lane, Entry] | None:
        """A marked record is tracked in its key's lane (`suspected`: it goes alone); None if it was already (then
        it is sent as it is now, if it was not sent yet). Core then holds it again (known poison) or enqueues it."""
        known = self.entries.get(record.id)
        if known is not None:
            if known.state is EntryState.QUEUED:
                known.record = record  # marked again before it was sent (requeued): send it as it is now
            return None
        entry = Entry(record, self.core.now, solo=suspected)
        self.entries[record.id] = entry
        lane = self.lanes.get(record.key)
        if lane is None:
            lane = self.lanes[record.key] = Lane(record.key)
        return lane, entry

    def enqueue(self, lane: Lane, entry: Entry) -> None:
        """An admitted record waits in its key's lane."""
        record = entry.record
        if lane.waiting:
            if len(lane.queued) >= HELD_BACKLOG:
                del self.entries[record.id]
                lane.overflowed = True  # stays marked; releasing the key re-marks it under a new leader id
            else:
                lane.queued.append(entry)
            return
        lane.queued.append(entry)
        self.queued += 1
        self.make_ready(lane)

    def abandon_queued(self) -> None:
        """Forget records not sent: they stay marked, and the next term re-marks them (and re-holds
        the poison among them: what is known of poison outlives the term)."""
        for lane in list(self.lanes.values()):
            for record_id in lane.abandon():
                self.entries.pop(record_id, None)
            if not lane.unsettled:
                del self.lanes[lane.key]
        self.ready.clear()
        self._blocked.clear()
        self.queued = 0
        if self.solo is not None and self.solo.state is not EntryState.SENT:
            self.solo = None

    # -- sending --------------------------------------------------------------------------------

    def make_ready(self, lane: Lane, *, first: bool = False) -> None:
        if lane.ready or not lane.queued or (lane.waiting and not lane.retrying):
            return
        lane.ready = True
        if first:
            self.ready.appendleft(lane)
        else:
            self.ready.append(lane)

    def slots(self, lane: Lane) -> int:
        queued = lane.queued
        alone = lane.single or lane.retrying or bool(queued and queued[0].record.topic not in lane.acked_topics)
        limit = 1 if alone else self.limits.max_in_flight_per_key
        return limit - len(lane.unsettled)

    def dispatch(self, remarking: bool) -> list[Lane]:
        """Send ready records while the throttle and each key's slots allow (nothing while the term is being
        re-marked). Returns the lanes held again on a known poison record that came first (for the poison book)."""
        self.settle_wanted = True  # until this dispatch finds nothing waiting on a settle
        if self._blocked:  # keys freed meanwhile (settled, held, abandoned) no longer wait
            self._blocked = {key for key in self._blocked if (lane := self.lanes.get(key)) is not None
                             and lane.queued and self.slots(lane) <= 0}
        held: list[Lane] = []
        if remarking or self.aborted or self.core.now < self._paused_until:
            return held
        if self.solo is not None:
            self._send_solo()
            return held
        limit = self.limits.max_in_flight_records
        ready = self.ready
        batch: list[Record] = []
        while ready and self.in_flight < limit:
            lane = ready.popleft()
            lane.ready = False
            if not lane.queued or self.slots(lane) <= 0 or self.lanes.get(lane.key) is not lane \
                    or (lane.waiting and not lane.retrying):
                if lane.queued and self.slots(lane) <= 0:
                    self._blocked.add(lane.key)  # ready again once one of its records settles
                continue
            entry = lane.queued[0]
            if entry.rehold:
                lane.queued.popleft()
                self.queued -= 1
                entry.rehold = False
                self.hold(lane, entry)
                held.append(lane)
                continue
            if entry.solo:
                self.solo = entry  # it goes alone, once everything in flight has settled
                self.make_ready(lane, first=True)
                break
            lane.queued.popleft()
            self._send(lane, entry, batch)
            if lane.queued and self.slots(lane) > 0:
                lane.ready = True
                ready.append(lane)
            elif lane.queued:
                self._blocked.add(lane.key)
        if batch:
            self.core.command(cmd.Send(tuple(batch)))
        if self.solo is not None and not batch:
            self._send_solo()
        # Lanes left ready: the throttle is full; a solo record waits for everything in flight to settle.
        self.settle_wanted = bool(self._blocked) or bool(ready) or self.solo is not None
        return held

    def _send_solo(self) -> None:
        entry = self.solo
        if entry.state is not EntryState.QUEUED or self.in_flight:
            return
        lane = self.lanes.get(entry.record.key)
        if lane is None or not lane.queued or lane.queued[0] is not entry:
            self.solo = None
            return
        lane.queued.popleft()
        lane.ready = False
        batch: list[Record] = []
        self._send(lane, entry, batch)
        self.core.command(cmd.Send(tuple(batch)))

    def _send(self, lane: Lane, entry: Entry, batch: list[Record]) -> None:
        if lane.held is not entry:
            self.queued -= 1
        entry.state = EntryState.SENT
        entry.sent_at = self.core.now
        entry.sent_alone = not self.in_flight and not batch
        if not lane.unsettled:
            self.busy[lane.key] = None
        lane.unsettled.append(entry)
        self.in_flight += 1
        self._sent.append(entry)
        batch.append(entry.record)

    def unsend(self, entry: Entry) -> None:
        """Undo a send that never left the process."""
        lane = self.lanes[entry.record.key]
        self.forget_unsettled(lane, entry)
        self.in_flight -= 1
        entry.state = EntryState.QUEUED

    # -- held keys (the poison book decides which; Core tells) -----------------------------------------

    def hold(self, lane: Lane, entry: Entry) -> None:
        """The key waits behind `entry`, held (it stays marked); its later records wait behind it, uncounted."""
        if not lane.waiting:
            self.queued -= len(lane.queued)
        self.entries[entry.record.id] = entry
        lane.hold(entry)

    def retry_held(self, lane: Lane, record: Record) -> None:
        """The held record goes out again, alone and first, as `record` (Lane.retry)."""
        lane.retry(record)
        self.make_ready(lane, first=True)

    def unhold(self, lane: Lane, *, gone: bool) -> bool:
        """The key moves again (`gone`: its held record was deleted or parked, and is forgotten). True when records
        behind it were left marked in the table (HELD_BACKLOG): a new leader id must pick them up."""
        entry = lane.held
        if gone and self.entries.get(entry.record.id) is entry:
            del self.entries[entry.record.id]
        lane.held = None
        lane.retrying = False
        self.queued += len(lane.queued)
        if lane.overflowed:
            lane.overflowed = False
            return True
        self._tidy(lane)
        return False

    def held_entry(self, record_id: int) -> tuple[Lane, Entry] | None:
        """The lane held by record `record_id`, and its entry; None if no key is held by it."""
        entry = self.entries.get(record_id)
        lane = self.lanes.get(entry.record.key) if entry is not None else None
        return (lane, entry) if lane is not None and lane.held is entry else None

    # -- settling -------------------------------------------------------------------------------

    def _purge_prefix(self, lane: Lane) -> None:
        """Queue a key's acknowledged records for purging in its order, up to its first unsettled one."""
        for entry in lane.acked_prefix():
            self.settling.queue_purge(entry, self.core.now)

    def _failed(self, entry: Entry, error: DeliveryError) -> Verdict | None:
        entry.state = EntryState.FAILED
        entry.error = error
        lane = self.lanes[entry.record.key]
        lane.single = True
        alone = entry is self.solo or (entry.sent_alone and self.in_flight == 1)
        if entry is self.solo:
            self.solo = None
        if alone and error.permanent:
            # It failed alone, so it is guilty: hold it (it stays marked; nothing to reset).
            self.forget_unsettled(lane, entry)
            self.in_flight -= 1
            self._purge_prefix(lane)
            return Verdict(Judged.FAILED_ALONE, lane, entry, str(error))
        self.settling.queue_reset(entry)
        core = self.core
        if not core.remarking:
            log.warning("Delivery of record %d (topic %s, key %r) failed: %s; re-marking", entry.record.id,
                        entry.record.topic, entry.record.key, error)
            core.remark()
        if error.fatal:
            self.restart_producer()
            self.abort(f"the producer failed: {error}")
        return Verdict(Judged.SUSPECT, lane, entry, str(error)) if error.permanent and not alone else None

    def settle(self, entry: Entry) -> None:
        """A purge or reset committed: the record leaves its lane, and its key's slot is free."""
        if self.entries.get(entry.record.id) is entry:
            del self.entries[entry.record.id]
        self.in_flight -= 1
        lane = self.lanes.get(entry.record.key)
        if lane is None:
            return
        unsettled = lane.unsettled
        self.forget_unsettled(lane, entry)
        if entry.purging:
            lane.purge_queued -= 1
        if unsettled:
            self._purge_prefix(lane)
        self._blocked.discard(lane.key)
        self._tidy(lane)

    def _tidy(self, lane: Lane) -> None:
        """A lane with records queued is ready to send; one with nothing left is forgotten."""
        if lane.queued:
            self.make_ready(lane)
        elif not lane.unsettled and lane.held is None:
            del self.lanes[lane.key]

    def forget_unsettled(self, lane: Lane, entry: Entry) -> None:
        lane.forget(entry)
        if not lane.unsettled:
            self.busy.pop(lane.key, None)

    def flush_settling(self, fenced: bool, active: bool = False) -> None:
        """Purge and reset what is due (Settling.flush)."""
        for command in self.settling.flush(self.core.now, fenced, active, self.settle_wanted):
            self.core.command(command)

    def purged(self) -> int:
        """The last Purge committed; returns how many records it settled."""
        return self._settle_all(self.settling.purge.done())

    def purge_failed(self, error: str) -> None:
        self.settling.purge_failed(self.core.now, error)

    def reset_done(self) -> int:
        """The last Reset committed; returns how many records it settled."""
        return self._settle_all(self.settling.reset.done())

    def _settle_all(self, entries: list[Entry]) -> int:
        for entry in entries:
            self.settle(entry)
        return len(entries)

    def reset_failed(self, error: str) -> None:
        self.settling.reset.failed(self.core.now, self.limits.io_error_backoff, error)


def check_invariants(lanes: Lanes) -> None:
    """Lanes' bookkeeping, asserted (Core.check_invariants: the simulator and the tests turn it on). One pass over the
    lanes, as it runs after every turn of the simulator."""
    limit = lanes.limits.max_in_flight_per_key
    busy = lanes.busy
    unsettled = queued = 0
    tracked: set[int] = set()  # a held record may also be in flight: a set, not a count
    for key, lane in lanes.lanes.items():
        in_flight = len(lane.unsettled)
        assert in_flight <= limit, f"key {key!r}: {in_flight} in flight, limit {limit}"
        assert (key in busy) == bool(in_flight), f"key {key!r}: busy list out of step"
        assert 0 <= lane.purge_queued <= in_flight
        ids = [entry.record.id for entry in lane.queued]
        assert ids == sorted(ids), f"key {key!r}: queued out of id order {ids[:5]}"
        tracked.update(ids)
        tracked.update([entry.record.id for entry in lane.unsettled])
        if lane.held is not None:
            tracked.add(lane.held.record.id)
        unsettled += in_flight
        if not lane.waiting:
            queued += len(ids)
    assert unsettled == lanes.in_flight, f"{unsettled} unsettled, in_flight says {lanes.in_flight}"
    assert lanes.entries.keys() == tracked, \
        f"entries out of step with the lanes: {sorted(set(lanes.entries) ^ tracked)[:5]}"
    assert queued == lanes.queued, f"{queued} queued, queued says {lanes.queued}"
    assert len(busy) <= len(lanes.lanes)
