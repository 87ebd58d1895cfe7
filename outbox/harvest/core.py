"""The harvester's core: one replica's leadership and records, as a single-threaded state machine.

Nothing here touches a socket, a thread or a clock. The shell (harvester.py, or the simulator in
the tests) feeds the core inputs: the time (`tick`), leader-election events, the outcome of every
command it ran. The core answers with commands (commands.py): take the fence, mark, send, purge,
reset, hold, park. Given the same inputs it gives the same commands, which is what lets a seeded
simulator replay a whole run, faults included.

How records move (goharvest's mark/purge/reset, "MP/R", with the differences noted):
- A term is one leader id. It begins once this replica leads (assigned partition 0 of the leader
  topic, own heartbeats seen), nothing of an earlier term is in flight, and the table's database
  fence is held. Leader ids are fresh at every acquisition and every refresh.
- Marked records wait in per-key lanes, in id order. At most `max_in_flight_per_key` records of a
  key are in flight (1 is goharvest's barrier) and `max_in_flight_records` in all (the throttle).
  A key's slot is freed only when the purge of its acknowledged record has committed: freeing it
  on the ack alone lets a crash replay R0 R1 after R1. A key's acknowledged records are purged in
  its order, never one while an earlier one of its key is unsettled.
- A failed delivery (or mark) resets the row, stops all sending, and once nothing is in flight
  begins a new term: the new leader id re-marks from the table's head, so the failed record goes
  out again before anything marked after it.
- A record that fails on its own with an error that will not go away (too large, not authorised)
  is held: its key waits, every other key goes on. If it failed among others (the broker refuses
  a whole batch), it is first sent again alone, so an innocent record is never held.
"""

from __future__ import annotations

import enum
import itertools
import logging
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from outbox.harvest import commands as cmd
from outbox.harvest import events
from outbox.harvest.commands import DeliveryError
from outbox.harvest.config import Limits
from outbox.harvest.contract import HeldRecord, Record, ReplicaState

log = logging.getLogger("outbox.harvest")

#: Records of a held key kept in memory behind the held one; beyond it they stay marked in the
#: table, and releasing the key re-marks them under a new leader id.
HELD_BACKLOG = 1000
#: How long an INSERT may take between taking its id (nextval) and writing its row (when its
#: transaction gets an xid). The watermark waits this long before trusting a snapshot.
SETTLE_DELAY = 1.0
#: A held record is retried at most this many `held_retry_after` apart.
MAX_RETRY_FACTOR = 16
#: Keys listed in a snapshot.
KEY_SAMPLE = 50
#: After giving up what was in flight when revoked (or stopping), how long the core waits for the
#: producer to report those records failed before it lets partition 0 go (or stops) regardless.
REVOKE_GRACE = 1.0
STOP_GRACE = 2.0


class Phase(enum.Enum):
    """Where the current term is."""

    IDLE = "idle"  # no term: not leading, or waiting for the last term's records to settle
    FENCING = "fencing"  # TakeFence sent
    BLOCKED = "blocked"  # another replica holds the fence; retried every fence_retry_interval
    ACTIVE = "active"  # marking and sending
    DRAINING = "draining"  # a failure forces a re-mark: nothing is sent until nothing is in flight


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


@dataclass(slots=True)
class Poison:
    """What this leadership knows of a record that failed on its own."""

    reason: str
    since: float
    attempts: int
    retry_at: float
    fingerprint: int


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
    #: Listed in the ready queue.
    ready: bool = False
    #: How many of `unsettled`, from the front, are acknowledged and queued for purging.
    purge_queued: int = 0

    @property
    def waiting(self) -> bool:
        """Its queued records are behind a held record (not counted as queued, never timed out)."""
        return self.held is not None


@dataclass(frozen=True)
class Snapshot:
    """What the replica reports about itself (status rows, metrics, health)."""

    state: ReplicaState
    #: The term it leads with (None while it does not lead with one).
    leader_id: uuid.UUID | None
    #: The leader id its rows in flight are marked under: the term's, or, while a term that ended
    #: (or is being refreshed) still has records in flight, that term's. Operators' tools treat rows
    #: marked with it as in flight.
    marking_id: uuid.UUID | None
    in_flight: int
    queued: int
    in_flight_keys: list[str]
    in_flight_key_count: int
    held: list[HeldRecord]
    fence_holder: str | None
    published: int
    failed: int


def fingerprint(record: Record) -> int:
    """What a record would publish, as one number: a held record whose content changed is retried."""
    return hash((record.topic, record.key, record.value, tuple(record.header_keys), tuple(record.header_values)))


class Core:
    """One replica's brain. Not thread-safe: one thread feeds it (the engine, or the simulator)."""

    def __init__(self, limits: Limits, *, new_leader_id: Callable[[], uuid.UUID] = uuid.uuid4,
                 park_after: int | None = None, now: float = 0.0) -> None:
        self.limits = limits
        self._new_leader_id = new_leader_id
        self._park_after = park_after
        self.now = now
        #: Assert the core's invariants after every input (see check_invariants).
        self.checking = False
        self._commands: list[cmd.Command] = []
        # -- leadership
        self.assigned = False
        self.fenced = False
        self.stopping = False
        #: Stopped: settled after stop(), or gave up waiting (the shell then closes everything).
        self.finished = False
        self._stop_at: float | None = None  # stopping: give up what is in flight at this time
        self._stop_aborted = False
        self._release_at: float | None = None  # revoked: give up what is in flight at this time
        self._release_aborted = False
        self._heartbeat_seen_at = now
        self._last_poll = now
        # -- term
        self.phase = Phase.IDLE
        self.leader_id: uuid.UUID | None = None
        self._last_term_id: uuid.UUID | None = None  # the last term that marked rows
        self._acquired = False  # a term began since the last acquisition: the next one is a refresh
        self._fence_retry_at = now
        self._fence_pending = False
        self.fence_holder: str | None = None
        self._grace_until = now  # after taking the fence from another group: no marks before this
        self.force_remark = False
        # -- marking
        self.listening = False
        self._mark_pending: cmd.Mark | None = None
        self._next_mark_at = now
        self._notified = False
        self._high_water = 0  # the highest id this term has marked
        self._watermark = 0  # every id at or below is settled and was seen by this term's marks
        self._samples: deque[tuple[float, int, int]] = deque()  # (time, high water, snapshot xmax) per mark
        self._next_rescan_at = now
        self._rescan_from: int | None = None  # a rescan under way continues after this id
        # -- records
        self._entries: dict[int, Entry] = {}
        self._lanes: dict[str, Lane] = {}
        self._busy: dict[str, None] = {}  # keys with records in flight, oldest first (for snapshots)
        self._ready: deque[Lane] = deque()
        self.queued = 0  # queued records not waiting behind a held one
        self.in_flight = 0  # sent and not yet settled (purged or reset)
        self._sent: deque[Entry] = deque()  # in send order, for the delivery timeout
        self._solo: Entry | None = None
        self._paused_until = now  # the producer's queue was full
        self._next_queue_check = now
        # -- settling
        self._to_purge: list[Entry] = []
        self._purging: list[Entry] | None = None
        self._purge_retry_at = now
        self._to_reset: list[Entry] = []
        self._resetting: list[Entry] | None = None
        self._reset_retry_at = now
        self._aborted = False  # AbortSends issued; nothing more is sent until all in flight settled
        self._restarting = False  # RestartProducer issued, not yet answered
        # -- poison
        self._suspects: dict[int, str] = {}  # failed among others with a permanent error: send alone
        self._poison: dict[int, Poison] = {}  # failed alone: held
        self._held: dict[str, Lane] = {}
        self._held_check_at = now
        self._checking_held = False
        self._asked: dict[int, int] = {}  # record id -> its lane's holds when the CheckHeld under way was asked
        self._parking: set[int] = set()
        # -- counts
        self.published = 0
        self.failed = 0

    # ============================================================================ the outside

    def take_commands(self) -> list[cmd.Command]:
        """What to do now; the caller runs them and reports back. Call after every input."""
        self._advance()
        if self.checking:
            self.check_invariants()
        commands, self._commands = self._commands, []
        return commands

    def check_invariants(self) -> None:
        """The core's own bookkeeping, asserted (as goharvest does in its loop); the simulator and the
        tests turn it on with `checking`, production does not pay for it."""
        limit = self.limits.max_in_flight_per_key
        unsettled = queued = 0
        for key, lane in self._lanes.items():
            assert len(lane.unsettled) <= limit, f"key {key!r}: {len(lane.unsettled)} in flight, limit {limit}"
            assert (key in self._busy) == bool(lane.unsettled), f"key {key!r}: busy list out of step"
            assert 0 <= lane.purge_queued <= len(lane.unsettled)
            ids = [entry.record.id for entry in lane.queued]
            assert ids == sorted(ids), f"key {key!r}: queued out of id order {ids[:5]}"
            unsettled += len(lane.unsettled)
            if not lane.waiting:
                queued += len(lane.queued)
        assert unsettled == self.in_flight, f"{unsettled} unsettled, in_flight says {self.in_flight}"
        assert queued == self.queued, f"{queued} queued, queued says {self.queued}"
        assert len(self._busy) <= len(self._lanes)
        if self.phase is Phase.ACTIVE:
            assert self.leading and self.leader_id is not None

    def next_deadline(self) -> float:
        """The latest time the core wants to be ticked again (it may be ticked any time before)."""
        limits = self.limits
        deadline = self.now + limits.drain_interval
        if self.assigned and not self.fenced:
            deadline = min(deadline, self._heartbeat_seen_at + limits.heartbeat_timeout)
        if self.phase is Phase.ACTIVE:
            if self._mark_pending is None and self._wants_records():
                deadline = min(deadline, max(self._grace_until, min(self._next_mark_at, self._next_rescan_at)))
            if self._held and not self._checking_held:
                deadline = min(deadline, self._held_check_at)
            if self._ready and self._paused_until > self.now:
                deadline = min(deadline, self._paused_until)
        if self.phase in (Phase.FENCING, Phase.BLOCKED) and not self._fence_pending:
            deadline = min(deadline, self._fence_retry_at)
        if self._release_at is not None:
            deadline = min(deadline, self._release_at)
        if self._stop_at is not None and not self.finished:
            deadline = min(deadline, self._stop_at)
        if self._to_purge and self._purging is None:
            deadline = min(deadline, self._purge_retry_at)
        if self._to_reset and self._resetting is None:
            deadline = min(deadline, self._reset_retry_at)
        if self._sent and not self._aborted:
            deadline = min(deadline, self._sent[0].sent_at + limits.delivery_timeout)
        return max(self.now, deadline)

    def snapshot(self) -> Snapshot:
        keys = list(itertools.islice(self._busy, KEY_SAMPLE))
        held = []
        for key, lane in self._held.items():
            entry = lane.held
            poison = self._poison.get(entry.record.id) if entry is not None else None
            if poison is not None:
                held.append(HeldRecord(entry.record.id, key, entry.record.topic, poison.reason, poison.attempts,
                                       self.now - poison.since, len(lane.queued) - (entry in lane.queued),
                                       lane.overflowed))
        marking = self.leader_id if self.phase in (Phase.ACTIVE, Phase.DRAINING) else None
        if marking is None and (self.in_flight or self._held):
            marking = self._last_term_id
        return Snapshot(state=self.state, leader_id=self.leader_id if self.phase is Phase.ACTIVE else None,
                        marking_id=marking,
                        in_flight=self.in_flight, queued=self.queued, in_flight_keys=keys,
                        in_flight_key_count=len(self._busy), held=held, fence_holder=self.fence_holder,
                        published=self.published, failed=self.failed)

    @property
    def state(self) -> ReplicaState:
        if self.stopping:
            return ReplicaState.STOPPING
        if self.phase is Phase.BLOCKED:
            return ReplicaState.BLOCKED
        if self.assigned and self.fenced:
            return ReplicaState.FENCED
        if self.leading:
            return ReplicaState.LEADER
        return ReplicaState.STANDBY

    @property
    def leading(self) -> bool:
        """Assigned partition 0 and seeing its own heartbeats: allowed to publish (fence permitting)."""
        return self.assigned and not self.fenced and not self.stopping

    @property
    def settled(self) -> bool:
        """Nothing sent is waiting for its outcome, and no purge or reset is pending."""
        return not self.in_flight

    # ============================================================================ time

    def tick(self, now: float) -> None:
        """The time is `now`; earlier times are ignored."""
        if now > self.now:
            self.now = now
        limits = self.limits
        if self.assigned and not self.fenced and self.now >= self._heartbeat_seen_at + limits.heartbeat_timeout:
            # Kafka may hand partition 0 to another replica before this one hears of it; stop
            # sending well before that could happen (its session timeout is 3x this).
            log.warning("Fenced: no own heartbeat for %.1fs", self.now - self._heartbeat_seen_at)
            self.fenced = True
            self._end_term(events.LeaderFenced(), abort=True)
        if self.phase is Phase.ACTIVE and not self.force_remark:
            if self.now - self._last_poll > limits.max_poll_interval:
                log.warning("Poll deadline exceeded (%.1fs without polling the leader topic); re-marking",
                            self.now - self._last_poll)
                self._remark()
            elif self.queued and self.now >= self._next_queue_check:
                # Scanning the lanes costs O(keys): look a few times per timeout, not every tick.
                self._next_queue_check = self.now + min(1.0, limits.queue_timeout / 4)
                if self._oldest_queued_age() > limits.queue_timeout:
                    log.warning("Queue timeout: a marked record waited more than %.1fs to be sent; re-marking",
                                limits.queue_timeout)
                    self._remark()
        sent = self._sent
        while sent and sent[0].state is not EntryState.SENT:
            sent.popleft()
        if sent and not self._aborted and self.now >= sent[0].sent_at + limits.delivery_timeout:
            self.abort(f"a record was not acknowledged within {limits.delivery_timeout:g}s")

    def abort(self, reason: str) -> None:
        """Give up every record in flight: the shell drops them from the producer and reports each failed."""
        if not self._aborted and self.in_flight:
            self._aborted = True
            log.warning("Giving up %d record(s) in flight: %s", self.in_flight, reason)
            self._commands.append(cmd.AbortSends(reason))

    # ============================================================================ leadership

    def on_polled(self, heartbeat_seen: bool = False) -> None:
        """The shell polled the leader topic (so Kafka knows this replica is alive), and whether one
        of this replica's own heartbeats came back."""
        self._last_poll = self.now
        if heartbeat_seen:
            self.on_heartbeat_seen()

    def on_assigned(self) -> None:
        """Partition 0 of the leader topic was assigned to this replica: it leads."""
        if self.assigned:
            return
        log.info("Assigned partition 0 of the leader topic: leading")
        self.assigned = True
        self.fenced = False
        self._acquired = False
        self._heartbeat_seen_at = self.now

    def on_heartbeat_seen(self) -> None:
        """One of this replica's own heartbeats came back from the leader topic."""
        self._heartbeat_seen_at = self.now
        if self.assigned and self.fenced:
            log.info("Resumed leader status (own heartbeat received)")
            self.fenced = False
            self._acquired = False

    def on_revoked(self) -> None:
        """Partition 0 is being revoked in a rebalance. Kafka hands it on once the shell answers
        ReleasePartition, which the core asks for when what is in flight has settled, so the next
        leader does not send it again (or after settle_timeout, having given it up)."""
        self._lose("revoked", abort=False)
        if self._release_at is None:
            self._release_at = self.now + self.limits.settle_timeout
            self._release_aborted = False

    def on_lost(self) -> None:
        """The assignment was lost (the session expired): another replica may lead already."""
        self._lose("lost", abort=True)

    def _lose(self, how: str, *, abort: bool) -> None:
        if not self.assigned:
            return
        log.info("Partition 0 of the leader topic %s", how)
        was_leading = self.leading
        self.assigned = False
        self.fenced = False
        self._end_term(events.LeaderRevoked() if was_leading or how == "lost" else None, abort=abort)
        self._poison.clear()
        self._suspects.clear()

    def stop(self) -> None:
        """Stop marking and sending; records in flight may still settle, for up to settle_timeout
        (then they are given up); `finished` says when the shell may close everything."""
        if self.stopping:
            return
        self.stopping = True
        self._stop_at = self.now + self.limits.settle_timeout
        self._end_term(None, abort=False)

    # ============================================================================ database answers

    def on_fence(self, leader_id: uuid.UUID, taken: bool, holder: str | None = None) -> None:
        """The answer to TakeFence."""
        if leader_id != self.leader_id or self.phase not in (Phase.FENCING, Phase.BLOCKED):
            return
        self._fence_pending = False
        if taken:
            if self.fence_holder is not None:
                # Another group published until a moment ago: let its last records land first.
                grace = self.limits.delivery_timeout + self.limits.heartbeat_timeout
                log.warning("Database fence taken (it was held by %s); marking in %.1fs, once that replica's last "
                            "records have landed", self.fence_holder, grace)
                self._grace_until = self.now + grace
                self.fence_holder = None
            self._activate()
            return
        if holder != self.fence_holder:
            log.error("Leading the group, but another replica holds this table's database fence (%s): "
                      "marking nothing until it is released", holder)
            self._announce(events.LeaderBlocked(holder or "unknown"))
        self.fence_holder = holder or "unknown"
        self.phase = Phase.BLOCKED
        self._fence_retry_at = self.now + self.limits.fence_retry_interval

    def on_fence_failed(self, leader_id: uuid.UUID, error: str) -> None:
        """TakeFence raised (the database is unreachable): try again after io_error_backoff."""
        if leader_id != self.leader_id:
            return
        self._fence_pending = False
        log.warning("Could not take the database fence, retrying in %.1fs: %s", self.limits.io_error_backoff, error)
        self._fence_retry_at = self.now + self.limits.io_error_backoff

    def on_listening(self, listening: bool) -> None:
        """Whether a NOTIFY wakes this replica when rows are written (else it polls every mark_backoff)."""
        self.listening = listening

    def on_notified(self) -> None:
        """A NOTIFY arrived: a writer committed rows (or an operator touched a held one)."""
        self._notified = True
        self._held_check_at = self.now

    def on_marked(self, mark: cmd.Mark, records: list[Record], snapshot: tuple[int, int] | None = None) -> None:
        """The rows a Mark marked, sorted by id, and the (xmin, xmax) of a database snapshot taken
        just before it (the oldest transaction still running, and the next transaction id)."""
        if mark is self._mark_pending:
            self._mark_pending = None
        if mark.leader_id != self.leader_id or self.phase is not Phase.ACTIVE:
            return  # marked under an id no longer current (or about to be replaced): the next term re-marks them
        limits = self.limits
        full = len(records) >= mark.limit
        if mark.rescan:
            self._rescan_from = records[-1].id if full else None
            if not full:
                self._next_rescan_at = self.now + limits.rescan_interval
        else:
            if records:
                self._high_water = max(self._high_water, records[-1].id)
            if snapshot is not None:
                self._advance_watermark(snapshot, covered=records[-1].id if full else None)
            if not full:
                # Everything visible is marked: wait for a NOTIFY, or look again later.
                self._next_mark_at = self.now + (limits.idle_poll_interval if self.listening else limits.mark_backoff)
        for record in records:
            self._take(record)

    def on_mark_failed(self, mark: cmd.Mark, error: str) -> None:
        """A Mark raised: its UPDATE may have committed all the same, so re-mark rather than retry."""
        if mark is self._mark_pending:
            self._mark_pending = None
        log.warning("Mark query failed, re-marking after %.1fs: %s", self.limits.io_error_backoff, error)
        self._next_mark_at = self.now + self.limits.io_error_backoff
        if mark.leader_id == self.leader_id and self.phase is Phase.ACTIVE:
            self._remark()

    def on_purged(self, fence_held: bool = True) -> None:
        """The last Purge committed: its rows are gone and their keys' slots are free. `fence_held`
        False: the purge found this replica's fence session no longer holding the fence."""
        if not fence_held:
            self._fence_lost()
        purging, self._purging = self._purging or [], None
        self.published += len(purging)
        for entry in purging:
            self._settle(entry)

    def on_purge_failed(self, error: str) -> None:
        """The last Purge failed: it is retried after io_error_backoff; the slots stay taken meanwhile."""
        log.warning("Purge of %d record(s) failed, retrying in %.1fs: %s", len(self._purging or ()),
                    self.limits.io_error_backoff, error)
        self._to_purge[:0] = self._purging or []
        self._purging = None
        self._purge_retry_at = self.now + self.limits.io_error_backoff

    def on_reset(self, fence_held: bool = True) -> None:
        """The last Reset committed: the failed rows will be re-marked."""
        if not fence_held:
            self._fence_lost()
        resetting, self._resetting = self._resetting or [], None
        self.failed += len(resetting)
        for entry in resetting:
            self._settle(entry)

    def on_reset_failed(self, error: str) -> None:
        log.warning("Reset of %d record(s) failed, retrying in %.1fs: %s", len(self._resetting or ()),
                    self.limits.io_error_backoff, error)
        self._to_reset[:0] = self._resetting or []
        self._resetting = None
        self._reset_retry_at = self.now + self.limits.io_error_backoff

    def on_held(self, record_id: int, version: int | None) -> None:
        """A Hold committed; `version` is the row's version after it (None: the row is not ours any more)."""
        entry = self._entries.get(record_id)
        lane = self._lanes.get(entry.record.key) if entry is not None else None
        if lane is not None and lane.held is entry:
            if version is not None:
                entry.record.version = version
            lane.version_known = True

    def on_held_checked(self, check: cmd.CheckHeld, rows: dict[int, Record]) -> None:
        """The held rows CheckHeld asked for, as they are now (an id missing: the row is gone)."""
        self._checking_held = False
        self._held_check_at = self.now + self.limits.held_check_interval
        asked, self._asked = self._asked, {}
        for lane in list(self._held.values()):
            entry = lane.held
            if entry is None or lane.retrying or entry.record.id in self._parking \
                    or asked.get(entry.record.id) != lane.holds:
                continue  # not asked about, or held again since (the answer may predate that Hold)
            record = entry.record
            poison = self._poison.get(record.id)
            current = rows.get(record.id)
            if current is None:
                self._release(lane, "its row was deleted or parked")
            elif lane.version_known and current.version != record.version:
                self._retry(lane, current, "its row changed")
            elif poison is not None and self.now >= poison.retry_at:
                self._retry(lane, current, "retrying after a pause")

    def on_held_check_failed(self, error: str) -> None:
        self._checking_held = False
        self._asked = {}
        self._held_check_at = self.now + self.limits.io_error_backoff
        log.warning("Could not re-read held records: %s", error)

    def on_parked(self, record_id: int, parked: bool) -> None:
        """A Park committed (`parked` False: the row was not there any more)."""
        self._parking.discard(record_id)
        entry = self._entries.get(record_id)
        lane = self._lanes.get(entry.record.key) if entry is not None else None
        if lane is None or lane.held is not entry:
            return
        if parked:
            reason = self._poison[record_id].reason if record_id in self._poison else ""
            self._announce(events.RecordParked(record_id, entry.record.key, reason))
        self._release(lane, "parked" if parked else "its row was gone when parking it")

    def on_park_failed(self, record_id: int, error: str) -> None:
        self._parking.discard(record_id)
        log.warning("Parking record %d failed (it stays held): %s", record_id, error)
        poison = self._poison.get(record_id)
        if poison is not None:
            poison.retry_at = self.now + self.limits.io_error_backoff

    # ============================================================================ Kafka answers

    def on_delivered(self, record_id: int, error: DeliveryError | None = None) -> None:
        """A delivery report: acknowledged (error None) or failed."""
        entry = self._entries.get(record_id)
        if entry is None or entry.state is not EntryState.SENT:
            return
        self._paused_until = self.now
        if error is not None:
            self._failed(entry, error)
            return
        entry.state = EntryState.ACKED
        lane = self._lanes[entry.record.key]
        lane.single = False
        if entry is self._solo:
            self._solo = None
            self._suspects.pop(record_id, None)
            if lane.held is entry:
                self._unhold(lane, "published when retried")
            self._poison.pop(record_id, None)
        self._purge_prefix(lane)

    def on_refused(self, record_id: int, error: DeliveryError) -> None:
        """produce() refused the record before it left the process (too large for the producer...)."""
        entry = self._entries.get(record_id)
        if entry is None or entry.state is not EntryState.SENT:
            return
        if not error.permanent:
            self._failed(entry, error)
            return
        # It never left: it is guilty on its own, and nothing needs resetting.
        self._unsend(entry)
        if entry is self._solo:
            self._solo = None
        self._hold(entry, str(error))

    def on_backpressure(self, record_ids: Iterable[int]) -> None:
        """The producer's local queue was full: these records were not sent; send them a little later."""
        for record_id in reversed(list(record_ids)):
            entry = self._entries.get(record_id)
            if entry is None or entry.state is not EntryState.SENT:
                continue
            self._unsend(entry)
            lane = self._lanes[entry.record.key]
            lane.queued.appendleft(entry)
            if not lane.waiting:
                self.queued += 1
            self._make_ready(lane, first=True)
        self._paused_until = self.now + min(self.limits.io_error_backoff, 0.05)

    def on_producer_failed(self, error: DeliveryError) -> None:
        """The producer hit a fatal error: every record in it fails; it must be replaced."""
        log.error("Record producer failed, replacing it: %s", error)
        self._restart_producer()
        self.abort(f"the producer failed: {error}")

    def on_producer_restarted(self) -> None:
        self._restarting = False

    # ============================================================================ inside

    def _advance(self) -> None:
        """Everything the core can do now: start or refresh terms, mark, send, purge, reset."""
        if self._aborted and not self.in_flight:
            self._aborted = False
        if self._release_at is not None:
            self._settle_revoke()
        if self.stopping and not self.finished:
            self._settle_stop()
        quiet = not self.in_flight and not self._restarting
        if self.phase is Phase.IDLE and self.leading and quiet:
            self._begin_term()
        elif self.phase in (Phase.FENCING, Phase.BLOCKED) and not self._fence_pending \
                and self.now >= self._fence_retry_at:
            self._fence_pending = True
            self._commands.append(cmd.TakeFence(self.leader_id))
        elif self.phase is Phase.DRAINING and quiet:
            self._begin_term()  # a refresh: a new leader id re-marks what is left
        if self.phase is Phase.ACTIVE:
            self._check_held()
            self._dispatch()
            self._mark()
        self._flush_settling()

    def _settle_revoke(self) -> None:
        if self.settled:
            self._release_at = None
            self._commands.append(cmd.ReleasePartition())
        elif self.now >= self._release_at:
            if not self._release_aborted:
                self._release_aborted = True
                self._release_at = self.now + REVOKE_GRACE
                self.abort("partition 0 was revoked")
            else:
                log.warning("Letting partition 0 go with %d record(s) unsettled", self.in_flight)
                self._release_at = None
                self._commands.append(cmd.ReleasePartition())

    def _settle_stop(self) -> None:
        if self.settled:
            self.finished = True
        elif self.now >= self._stop_at:
            if not self._stop_aborted:
                self._stop_aborted = True
                self._stop_at = self.now + STOP_GRACE
                self.abort("stopping")
            else:
                log.warning("Stopping with %d record(s) unsettled; the next leader re-marks them", self.in_flight)
                self.finished = True

    # -- terms ----------------------------------------------------------------------------------

    def _begin_term(self) -> None:
        self.leader_id = self._new_leader_id()  # fresh at every acquisition and refresh, never reused
        self.phase = Phase.FENCING
        self._fence_pending = True
        self._commands.append(cmd.TakeFence(self.leader_id))

    def _activate(self) -> None:
        self._last_term_id = self.leader_id
        refreshed = self._acquired
        self._acquired = True
        self.phase = Phase.ACTIVE
        self.force_remark = False
        self._high_water = 0
        self._watermark = 0
        self._samples.clear()
        self._rescan_from = None
        self._next_rescan_at = self.now + self.limits.rescan_interval
        self._next_mark_at = self.now
        self._mark_pending = None
        if refreshed:
            log.warning("Refreshed leader id: %s", self.leader_id)
            self._announce(events.LeaderRefreshed(self.leader_id))
        else:
            log.info("Leading with leader id %s", self.leader_id)
            self._announce(events.LeaderAcquired(self.leader_id))

    def _fence_lost(self) -> None:
        """The fence session ended (a dropped connection, or another leader ended it): someone else
        may mark now, so send nothing more; a new term takes the fence again first."""
        if self.phase in (Phase.ACTIVE, Phase.DRAINING) and not self.stopping:
            log.error("Lost the database fence (its session ended, or a pooler in transaction mode moved it: the "
                      "harvester needs a direct or session-pooled connection): stopped sending; taking it again")
            self.abort("the database fence was lost")
            self._remark()
            self.phase = Phase.DRAINING

    def _remark(self) -> None:
        """Stop sending; once nothing is in flight, a new leader id re-marks everything (goharvest A9)."""
        self.force_remark = True
        self._abandon_queued()
        if self.phase is Phase.ACTIVE:
            self.phase = Phase.DRAINING

    def _end_term(self, event: events.Event | None, *, abort: bool) -> None:
        """Leadership is gone (or going): drop what is queued; what is in flight settles by itself."""
        had_term = self.phase is not Phase.IDLE
        self._abandon_queued()
        self.phase = Phase.IDLE
        self.leader_id = None
        self.force_remark = False
        self._mark_pending = None
        self._fence_pending = False
        self.fence_holder = None
        if had_term:
            self._commands.append(cmd.ReleaseFence())
        if abort:
            self.abort("leadership lost")
        if event is not None:
            self._announce(event)

    def _abandon_queued(self) -> None:
        """Forget records not sent: they stay marked, and the next term re-marks them (and re-holds
        the poison among them: what is known of poison outlives the term)."""
        for lane in list(self._lanes.values()):
            for entry in lane.queued:
                self._entries.pop(entry.record.id, None)
            lane.queued.clear()
            if lane.held is not None:
                if lane.held.state is EntryState.HELD:
                    self._entries.pop(lane.held.record.id, None)
                lane.held = None
            lane.retrying = lane.overflowed = lane.ready = False
            if not lane.unsettled:
                del self._lanes[lane.key]
        self._held.clear()
        self._ready.clear()
        self.queued = 0
        self._parking.clear()
        self._checking_held = False
        if self._solo is not None and self._solo.state is not EntryState.SENT:
            self._solo = None

    # -- marking --------------------------------------------------------------------------------

    def _wants_records(self) -> bool:
        """Mark more only while few records wait: memory stays bounded and marks stay cheap."""
        return not self.force_remark and self.queued < self.limits.mark_query_records

    def _mark(self) -> None:
        if self._mark_pending is not None or not self._wants_records() or self.now < self._grace_until:
            return
        limit = self.limits.mark_query_records
        if not self._watermark and self.now >= self._next_rescan_at:
            self._next_rescan_at = self.now + self.limits.rescan_interval  # nothing below the marks yet
        if self._rescan_from is not None or (self._watermark and self.now >= self._next_rescan_at):
            after = self._rescan_from or 0
            self._rescan_from = after
            mark = cmd.Mark(self.leader_id, limit, after=after, upto=self._watermark)
        elif self._notified or self.now >= self._next_mark_at:
            mark = cmd.Mark(self.leader_id, limit, after=self._watermark)
        else:
            return
        self._notified = False
        self._mark_pending = mark
        self._commands.append(mark)

    def _advance_watermark(self, snapshot: tuple[int, int], covered: int | None) -> None:
        """Marks walk up from the watermark, past this term's own marked rows: the watermark is where
        nothing below can still appear. An id is taken (nextval) before its row is written, and rows
        commit out of id order, so a row below the newest marked one may still turn up; skipping it
        would let a later record of its key go first. So the watermark only rises to a high-water
        mark once every transaction that could own an id below it has finished: once the oldest
        running transaction (xmin) is younger than any that had begun SETTLE_DELAY after that
        high-water mark was seen (that snapshot's xmax), and a mark has since walked that far.
        `covered`: the last id this mark looked at (None: it looked at everything)."""
        xmin, xmax = snapshot
        samples = self._samples
        samples.append((self.now, self._high_water, xmax))
        best = self._watermark
        while len(samples) > 1:
            taken, high_water, _ = samples[0]
            later = next((s for s in samples if s[0] >= taken + SETTLE_DELAY), None)
            if later is None or xmin < later[2]:
                break
            best = max(best, high_water)
            samples.popleft()
        if covered is not None:
            best = min(best, covered)
        self._watermark = max(self._watermark, best)

    def _take(self, record: Record) -> None:
        """A marked record joins its key's lane."""
        known = self._entries.get(record.id)
        if known is not None:
            if known.state is EntryState.QUEUED:
                known.record = record  # marked again before it was sent (requeued): send it as it is now
            return
        entry = Entry(record, self.now, solo=record.id in self._suspects)
        self._entries[record.id] = entry
        lane = self._lanes.get(record.key)
        if lane is None:
            lane = self._lanes[record.key] = Lane(record.key)
        poison = self._poison.get(record.id)
        if poison is not None and lane.held is None:
            if poison.fingerprint == fingerprint(record):
                # Known poison, re-marked by a new term: held again without sending it again, once
                # the earlier records of its key queued before it have gone out.
                if not lane.queued:
                    self._hold_again(lane, entry)
                    return
                entry.rehold = True
            else:
                entry.solo = True  # it changed since it failed: try it, alone
        if lane.waiting:
            if len(lane.queued) >= HELD_BACKLOG:
                del self._entries[record.id]
                lane.overflowed = True  # stays marked; releasing the key re-marks it under a new leader id
            else:
                lane.queued.append(entry)
            return
        lane.queued.append(entry)
        self.queued += 1
        self._make_ready(lane)

    # -- sending --------------------------------------------------------------------------------

    def _make_ready(self, lane: Lane, *, first: bool = False) -> None:
        if lane.ready or not lane.queued or (lane.waiting and not lane.retrying):
            return
        lane.ready = True
        if first:
            self._ready.appendleft(lane)
        else:
            self._ready.append(lane)

    def _slots(self, lane: Lane) -> int:
        limit = 1 if lane.single or lane.retrying else self.limits.max_in_flight_per_key
        return limit - len(lane.unsettled)

    def _dispatch(self) -> None:
        """Send ready records while the throttle and each key's slots allow."""
        if self.force_remark or self._aborted or self.now < self._paused_until:
            return
        if self._solo is not None:
            self._send_solo()
            return
        limit = self.limits.max_in_flight_records
        ready = self._ready
        batch: list[Record] = []
        while ready and self.in_flight < limit:
            lane = ready.popleft()
            lane.ready = False
            if not lane.queued or self._slots(lane) <= 0 or self._lanes.get(lane.key) is not lane \
                    or (lane.waiting and not lane.retrying):
                continue
            entry = lane.queued[0]
            if entry.rehold:
                lane.queued.popleft()
                self.queued -= 1
                entry.rehold = False
                self._hold_again(lane, entry)
                continue
            if entry.solo:
                self._solo = entry  # it goes alone, once everything in flight has settled
                self._make_ready(lane, first=True)
                break
            lane.queued.popleft()
            self._send(lane, entry, batch)
            if lane.queued and self._slots(lane) > 0:
                lane.ready = True
                ready.append(lane)
        if batch:
            self._commands.append(cmd.Send(tuple(batch)))
        if self._solo is not None and not batch:
            self._send_solo()

    def _send_solo(self) -> None:
        entry = self._solo
        if entry.state is not EntryState.QUEUED or self.in_flight:
            return
        lane = self._lanes.get(entry.record.key)
        if lane is None or not lane.queued or lane.queued[0] is not entry:
            self._solo = None
            return
        lane.queued.popleft()
        lane.ready = False
        batch: list[Record] = []
        self._send(lane, entry, batch)
        self._commands.append(cmd.Send(tuple(batch)))

    def _send(self, lane: Lane, entry: Entry, batch: list[Record]) -> None:
        if lane.held is not entry:
            self.queued -= 1
        entry.state = EntryState.SENT
        entry.sent_at = self.now
        entry.sent_alone = not self.in_flight and not batch
        if not lane.unsettled:
            self._busy[lane.key] = None
        lane.unsettled.append(entry)
        self.in_flight += 1
        self._sent.append(entry)
        batch.append(entry.record)

    def _unsend(self, entry: Entry) -> None:
        """Undo a send that never left the process."""
        lane = self._lanes[entry.record.key]
        self._forget_unsettled(lane, entry)
        self.in_flight -= 1
        entry.state = EntryState.QUEUED

    # -- settling -------------------------------------------------------------------------------

    def _purge_prefix(self, lane: Lane) -> None:
        """Queue a key's acknowledged records for purging in its order, up to its first unsettled one."""
        unsettled = lane.unsettled
        index = lane.purge_queued
        while index < len(unsettled) and unsettled[index].state is EntryState.ACKED:
            entry = unsettled[index]
            entry.purging = True
            self._to_purge.append(entry)
            index += 1
        lane.purge_queued = index

    def _failed(self, entry: Entry, error: DeliveryError) -> None:
        entry.state = EntryState.FAILED
        entry.error = error
        lane = self._lanes[entry.record.key]
        lane.single = True
        alone = entry is self._solo or (entry.sent_alone and self.in_flight == 1)
        if entry is self._solo:
            self._solo = None
        if alone:
            if error.permanent:
                # It failed alone, so it is guilty: hold it (it stays marked; nothing to reset).
                self._suspects.pop(entry.record.id, None)
                self._forget_unsettled(lane, entry)
                self.in_flight -= 1
                self._hold(entry, str(error))
                self._purge_prefix(lane)
                return
        elif error.permanent:
            self._suspects[entry.record.id] = str(error)
        self._to_reset.append(entry)
        if not self.force_remark:
            log.warning("Delivery of record %d (topic %s, key %r) failed: %s; re-marking", entry.record.id,
                        entry.record.topic, entry.record.key, error)
            self._remark()
        if error.fatal:
            self._restart_producer()
            self.abort(f"the producer failed: {error}")

    def _settle(self, entry: Entry) -> None:
        """A purge or reset committed: the record leaves its lane, and its key's slot is free."""
        if self._entries.get(entry.record.id) is entry:
            del self._entries[entry.record.id]
        self.in_flight -= 1
        lane = self._lanes.get(entry.record.key)
        if lane is None:
            return
        unsettled = lane.unsettled
        self._forget_unsettled(lane, entry)
        if entry.purging:
            lane.purge_queued -= 1
        if unsettled:
            self._purge_prefix(lane)
        if lane.queued:
            self._make_ready(lane)
        elif not lane.unsettled and lane.held is None:
            del self._lanes[lane.key]

    def _forget_unsettled(self, lane: Lane, entry: Entry) -> None:
        unsettled = lane.unsettled
        if unsettled[0] is entry:
            del unsettled[0]
        else:
            unsettled.remove(entry)
        if not unsettled:
            self._busy.pop(lane.key, None)

    def _flush_settling(self) -> None:
        # While this replica leads, every purge and reset also checks that its fence is still held.
        fenced = self.phase in (Phase.ACTIVE, Phase.DRAINING)
        if self._to_purge and self._purging is None and self.now >= self._purge_retry_at:
            self._purging, self._to_purge = self._to_purge, []
            self._commands.append(cmd.Purge(tuple((e.record.id, e.record.leader_id) for e in self._purging),
                                            fenced))
        if self._to_reset and self._resetting is None and self.now >= self._reset_retry_at:
            self._resetting, self._to_reset = self._to_reset, []
            self._commands.append(cmd.Reset(tuple((e.record.id, e.record.leader_id) for e in self._resetting),
                                            tuple(str(e.error) for e in self._resetting), fenced))

    def _restart_producer(self) -> None:
        if not self._restarting:
            self._restarting = True
            self._commands.append(cmd.RestartProducer())

    # -- poison ---------------------------------------------------------------------------------

    def _hold(self, entry: Entry, reason: str) -> None:
        """The record failed on its own: hold it (its key waits), or park it after `park_after` tries."""
        record = entry.record
        lane = self._lanes[record.key]
        poison = self._poison.get(record.id)
        attempts = poison.attempts + 1 if poison is not None else 1
        backoff = self.limits.held_retry_after * min(MAX_RETRY_FACTOR, 2 ** (attempts - 1))
        self._poison[record.id] = Poison(reason, poison.since if poison else self.now, attempts,
                                         self.now + backoff, fingerprint(record))
        first = lane.held is None
        if first:
            log.error("Holding key %r of topic %s: record %d cannot be published (%s); other keys go on",
                      record.key, record.topic, record.id, reason)
            self._announce(events.RecordHeld(record.id, record.key, reason))
        else:
            log.warning("Held record %d (key %r) failed again (attempt %d): %s", record.id, record.key, attempts,
                        reason)
        self._hold_again(lane, entry)
        lane.version_known = False
        self._commands.append(cmd.Hold(record.id, record.leader_id, reason))
        if self._park_after is not None and attempts >= self._park_after:
            self._parking.add(record.id)
            self._commands.append(cmd.Park(record, reason, attempts))

    def _hold_again(self, lane: Lane, entry: Entry) -> None:
        if not self._held:
            self._held_check_at = self.now + self.limits.held_check_interval
        if not lane.waiting:
            self.queued -= len(lane.queued)  # the key's later records wait behind it, uncounted
        entry.state = EntryState.HELD
        entry.solo = False
        self._entries[entry.record.id] = entry
        lane.holds += 1
        lane.held = entry
        lane.retrying = False
        lane.version_known = True
        lane.ready = False
        self._held[lane.key] = lane

    def _retry(self, lane: Lane, current: Record, why: str) -> None:
        entry = lane.held
        if current.leader_id != entry.record.leader_id:
            # Someone unmarked it (a raw requeue): re-mark from the head, so it keeps its place in its key.
            log.warning("Held record %d (key %r) was unmarked by someone else; re-marking", entry.record.id,
                        lane.key)
            self._remark()
            return
        log.info("Retrying held record %d (key %r): %s", entry.record.id, lane.key, why)
        entry.record = current
        entry.state = EntryState.QUEUED
        entry.solo = True
        lane.retrying = True
        lane.queued.appendleft(entry)
        self._make_ready(lane, first=True)

    def _check_held(self) -> None:
        if not self._held or self._checking_held or self.now < self._held_check_at:
            return
        # Only held records whose Hold has committed: an answer could otherwise predate it.
        ids = tuple(lane.held.record.id for lane in self._held.values()
                    if lane.held is not None and not lane.retrying and lane.version_known
                    and lane.held.record.id not in self._parking)
        if ids:
            self._checking_held = True
            self._asked = {lane.held.record.id: lane.holds for lane in self._held.values()
                           if lane.held is not None and lane.held.record.id in ids}
            self._commands.append(cmd.CheckHeld(ids))
        else:
            self._held_check_at = self.now + self.limits.held_check_interval

    def _release(self, lane: Lane, how: str) -> None:
        """The held record is gone (deleted or parked): forget it; its key moves on."""
        entry = lane.held
        if self._entries.get(entry.record.id) is entry:
            del self._entries[entry.record.id]
        self._unhold(lane, how)

    def _unhold(self, lane: Lane, how: str) -> None:
        entry = lane.held
        record_id = entry.record.id
        lane.held = None
        lane.retrying = False
        del self._held[lane.key]
        self._poison.pop(record_id, None)
        self._suspects.pop(record_id, None)
        log.info("Key %r moves again: held record %d %s", lane.key, record_id, how)
        self._announce(events.RecordReleased(record_id, lane.key, how))
        self.queued += len(lane.queued)
        if lane.overflowed:
            # Records behind it were left marked in the table: a new leader id picks them up.
            lane.overflowed = False
            self._remark()
        elif lane.queued:
            self._make_ready(lane)
        elif not lane.unsettled:
            del self._lanes[lane.key]

    def _oldest_queued_age(self) -> float:
        oldest = self.now
        for lane in self._lanes.values():
            if lane.queued and not lane.waiting:
                oldest = min(oldest, lane.queued[0].marked_at)
        return self.now - oldest

    def _announce(self, event: events.Event) -> None:
        self._commands.append(cmd.Announce(event))
