"""The core's poison book: records that fail on their own, and the keys they hold.

A record that fails on its own with an error that will not go away (too large, not authorised) is
held: its key waits, every other key goes on. If it failed among others (the broker refuses a whole
batch), it is first a suspect, sent again alone, so an innocent record is never held. A held record
is re-read every held_check_interval: deleted or parked, its key moves on; changed (an operator's
fix), or its retry time come, it is sent again, alone. After `park_after` failures it is parked.
What is known of poison outlives a term: a new term that re-marks it holds it again unsent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from outbox.harvest import commands as cmd
from outbox.harvest import events
from outbox.harvest.contract import HeldRecord, Record
from outbox.harvest.lanes import Entry, EntryState, Lane

if TYPE_CHECKING:
    from outbox.harvest.core import Core

log = logging.getLogger("outbox.harvest")

#: A held record is retried at most this many `held_retry_after` apart.
MAX_RETRY_FACTOR = 16


@dataclass(slots=True)
class Poison:
    """What this leadership knows of a record that failed on its own."""

    reason: str
    since: float
    attempts: int
    retry_at: float
    fingerprint: int


def fingerprint(record: Record) -> int:
    """What a record would publish, as one number: a held record whose content changed is retried."""
    return hash((record.topic, record.key, record.value, tuple(record.header_keys), tuple(record.header_values)))


class PoisonBook:
    """Suspects, held records and their keys, the checks of held rows, and parking."""

    def __init__(self, core: Core, park_after: int | None) -> None:
        self.core = core
        self.limits = core.limits
        self.park_after = park_after
        self._suspects: dict[int, str] = {}  # failed among others with a permanent error: send alone
        self._poison: dict[int, Poison] = {}  # failed alone: held
        self.held: dict[str, Lane] = {}
        self._check_at = core.now
        self._checking = False
        self._asked: dict[int, int] = {}  # record id -> its lane's holds when the CheckHeld under way was asked
        self._parking: set[int] = set()
        #: Held records to park once their Hold has answered (Park moves the version the Hold left).
        self._to_park: dict[int, tuple[str, int]] = {}

    # -- what the lanes report (Core hands it over) ----------------------------------------------------

    def suspected(self, record_id: int) -> bool:
        return record_id in self._suspects

    def suspect(self, record_id: int, reason: str) -> None:
        self._suspects[record_id] = reason

    def unsuspect(self, record_id: int) -> None:
        self._suspects.pop(record_id, None)

    def taken(self, lane: Lane, entry: Entry) -> bool:
        """A record was marked: True if it is known poison, to hold again at once without sending it (Core holds its
        lane, then tells held_again)."""
        record = entry.record
        poison = self._poison.get(record.id)
        if poison is None or lane.held is not None:
            return False
        if poison.fingerprint != fingerprint(record):
            entry.solo = True  # it changed since it failed: try it, alone
            return False
        # Known poison, re-marked by a new term: held again without sending it again, once the
        # earlier records of its key queued before it have gone out.
        if lane.queued:
            entry.rehold = True
            return False
        return True

    def published(self, lane: Lane, entry: Entry) -> None:
        """A record sent alone (a suspect, or a held record retried) was acknowledged: it was not poison."""
        record_id = entry.record.id
        self._suspects.pop(record_id, None)
        if lane.held is entry:
            self._unhold(lane, "published when retried")
        self._poison.pop(record_id, None)

    def forget(self) -> None:
        """Leadership was lost: another replica may act on these records meanwhile."""
        self._poison.clear()
        self._suspects.clear()

    def abandon(self) -> None:
        """The term's queued records were dropped (Lanes.abandon_queued): nothing is held any more."""
        self.held.clear()
        self._parking.clear()
        self._to_park.clear()
        self._checking = False

    def deadline(self, deadline: float) -> float:
        if self.held and not self._checking:
            deadline = min(deadline, self._check_at)
        return deadline

    def snapshot(self) -> list[HeldRecord]:
        held = []
        now = self.core.now
        for key, lane in self.held.items():
            entry = lane.held
            poison = self._poison.get(entry.record.id) if entry is not None else None
            if poison is not None:
                held.append(HeldRecord(entry.record.id, key, entry.record.topic, poison.reason, poison.attempts,
                                       now - poison.since, len(lane.queued) - (entry in lane.queued),
                                       lane.overflowed))
        return held

    def notified(self) -> None:
        """A NOTIFY (or an operator's touch): look at the held rows now."""
        self._check_at = self.core.now

    # -- holding --------------------------------------------------------------------------------

    def hold(self, lane: Lane, entry: Entry, reason: str) -> None:
        """The record failed on its own: hold it (its key waits), or park it after `park_after` tries."""
        core, record = self.core, entry.record
        poison = self._poison.get(record.id)
        attempts = poison.attempts + 1 if poison is not None else 1
        backoff = self.limits.held_retry_after * min(MAX_RETRY_FACTOR, 2 ** (attempts - 1))
        self._poison[record.id] = Poison(reason, poison.since if poison else core.now, attempts,
                                         core.now + backoff, fingerprint(record))
        held = lane.held
        first = held is None
        if held is not None and held is not entry and held.record.id > record.id:
            # An earlier record of the key failed on its own after a later one was held (it was in flight
            # then): the earlier one is held now, and the later one waits behind it, known poison. The
            # key stays held throughout, so what waits in its lane stays uncounted.
            held.state = EntryState.QUEUED
            held.rehold = True
            lane.queued.appendleft(held)
            first = True
        if first:
            log.error("Holding key %r of topic %s: record %d cannot be published (%s); other keys go on",
                      record.key, record.topic, record.id, reason)
            core.announce(events.RecordHeld(record.id, record.key, reason))
        elif held is not entry:
            # A later record of a held key failed on its own (defensive: it waits behind, known poison).
            log.warning("Record %d (key %r) cannot be published either (%s); it waits behind held record %d",
                        record.id, record.key, reason, held.record.id)
            entry.state = EntryState.QUEUED
            entry.rehold = True
            position = next((i for i, e in enumerate(lane.queued) if e.record.id > record.id), len(lane.queued))
            lane.queued.insert(position, entry)
            return
        else:
            log.warning("Held record %d (key %r) failed again (attempt %d): %s", record.id, record.key, attempts,
                        reason)
        core.hold_lane(lane, entry)
        self.held_again(lane)
        lane.version_known = False
        core.command(cmd.Hold(record.id, reason))
        if self.park_after is not None and attempts >= self.park_after:
            self._parking.add(record.id)
            self._to_park[record.id] = (reason, attempts)

    def held_again(self, lane: Lane) -> None:
        """The lane is held (Lanes.hold): its held row is checked every held_check_interval."""
        if not self.held:
            self._check_at = self.core.now + self.limits.held_check_interval
        self.held[lane.key] = lane

    def _retry(self, lane: Lane, current: Record, why: str) -> None:
        log.info("Retrying held record %d (key %r): %s", lane.held.record.id, lane.key, why)
        self.core.retry_held(lane, current)

    def _unhold(self, lane: Lane, how: str, *, gone: bool = False) -> None:
        """The key moves on (`gone`: its held record was deleted or parked, and is forgotten)."""
        record_id = lane.held.record.id
        del self.held[lane.key]
        self._poison.pop(record_id, None)
        self._suspects.pop(record_id, None)
        log.info("Key %r moves again: held record %d %s", lane.key, record_id, how)
        self.core.announce(events.RecordReleased(record_id, lane.key, how))
        self.core.unhold(lane, gone=gone)

    # -- checking held rows -------------------------------------------------------------------------

    def check(self) -> None:
        """Ask for the held rows as they are now, every held_check_interval."""
        core = self.core
        if not self.held or self._checking or core.now < self._check_at:
            return
        # Only held records whose Hold has committed: an answer could otherwise predate it.
        ids = tuple(lane.held.record.id for lane in self.held.values()
                    if lane.held is not None and not lane.retrying and lane.version_known
                    and lane.held.record.id not in self._parking)
        if ids:
            self._checking = True
            self._asked = {lane.held.record.id: lane.holds for lane in self.held.values()
                           if lane.held is not None and lane.held.record.id in ids}
            core.command(cmd.CheckHeld(ids))
        else:
            self._check_at = core.now + self.limits.held_check_interval

    def on_held(self, record_id: int, version: int | None, held: tuple[Lane, Entry] | None) -> None:
        """A Hold committed; `held`: the lane it holds, and its entry (None: it holds none now)."""
        pending = self._to_park.pop(record_id, None)
        if held is not None:
            lane, entry = held
            if version is not None:
                entry.record.version = version
            lane.version_known = True
            if pending is not None:
                self.core.command(cmd.Park(entry.record, *pending))
                return
        self._parking.discard(record_id)

    def on_held_checked(self, rows: dict[int, Record]) -> None:
        now = self.core.now
        self._checking = False
        self._check_at = now + self.limits.held_check_interval
        asked, self._asked = self._asked, {}
        for lane in list(self.held.values()):
            entry = lane.held
            if entry is None or lane.retrying or entry.record.id in self._parking \
                    or asked.get(entry.record.id) != lane.holds:
                continue  # not asked about, or held again since (the answer may predate that Hold)
            record = entry.record
            poison = self._poison.get(record.id)
            current = rows.get(record.id)
            if current is None:
                self._unhold(lane, "its row was deleted or parked", gone=True)
            elif lane.version_known and current.version != record.version:
                self._retry(lane, current, "its row changed")
            elif poison is not None and now >= poison.retry_at:
                self._retry(lane, current, "retrying after a pause")

    def on_held_check_failed(self, error: str) -> None:
        self._checking = False
        self._asked = {}
        self._check_at = self.core.now + self.limits.io_error_backoff
        log.warning("Could not re-read held records: %s", error)

    def on_parked(self, record_id: int, parked: bool, held: tuple[Lane, Entry] | None) -> None:
        """Parked; or not (the row is gone, or changed since its Hold): the next check of held rows decides.
        `held`: the lane the record holds, and its entry (None: it holds none now)."""
        self._parking.discard(record_id)
        if held is None:
            return
        lane, entry = held
        if not parked:
            self._check_at = self.core.now
            return
        reason = self._poison[record_id].reason if record_id in self._poison else ""
        self.core.announce(events.RecordParked(record_id, entry.record.key, reason))
        self._unhold(lane, "parked", gone=True)

    def on_park_failed(self, record_id: int, error: str) -> None:
        self._parking.discard(record_id)
        log.warning("Parking record %d failed (it stays held): %s", record_id, error)
        poison = self._poison.get(record_id)
        if poison is not None:
            poison.retry_at = self.core.now + self.limits.io_error_backoff
