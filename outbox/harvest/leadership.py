"""The core's leadership: partition 0 of the leader topic, heartbeats, the database fence and terms.

A term is one leader id. It begins once this replica leads (assigned partition 0, own heartbeats
seen), nothing of an earlier term is in flight, and the table's database fence is held. Leader ids
are fresh at every acquisition and every refresh. A replica that stops seeing its own heartbeat
within heartbeat_timeout fences itself, well before Kafka (three heartbeat timeouts) could give the
partition away. A failure forces a refresh: nothing more is sent, and once nothing is in flight a
new leader id re-marks from the table's head (goharvest's A9). A revoke, or a stop, waits for what
is in flight to settle (at most settle_timeout, then gives it up) before partition 0 goes.

A shard's engine (`core.handoff_by_fence`, shards.py) cannot hold its partition back like that: one
group consumer serves every shard of a replica, and Kafka hands a revoked partition on at once. The
database fence orders that hand-off instead: a shard's leader lets its fence go only once nothing it
sent is in flight, and the next leader waits for that (a holder of its own group is ended only after
the longest a settle can take, as a stale one). Taken from a leader of its own group that let go, the
fence needs no grace: that leader had settled.
"""

from __future__ import annotations

import enum
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from outbox.harvest import commands as cmd
from outbox.harvest import events

if TYPE_CHECKING:
    from outbox.harvest.core import Core

log = logging.getLogger("outbox.harvest")

#: After giving up what was in flight when revoked (or stopping), how long the core waits for the
#: producer to report those records failed before it lets partition 0 go (or stops) regardless.
REVOKE_GRACE = 1.0
STOP_GRACE = 2.0
#: A shard's next leader asks for the fence this often while the previous leader settles.
HANDOFF_RETRY = 0.2


class Phase(enum.Enum):
    """Where the current term is."""

    IDLE = "idle"  # no term: not leading, or waiting for the last term's records to settle
    FENCING = "fencing"  # TakeFence sent
    BLOCKED = "blocked"  # another replica holds the fence; retried every fence_retry_interval
    ACTIVE = "active"  # marking and sending
    DRAINING = "draining"  # a failure forces a re-mark: nothing is sent until nothing is in flight


class Leadership:
    """Whether this replica leads, with which leader id, and the lifecycle around it."""

    def __init__(self, core: Core, new_leader_id: Callable[[], uuid.UUID]) -> None:
        self.core = core
        self.limits = core.limits
        self._new_leader_id = new_leader_id
        now = core.now
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
        self.phase = Phase.IDLE
        self.leader_id: uuid.UUID | None = None
        self.last_term_id: uuid.UUID | None = None  # the last term that marked rows
        self._acquired = False  # a term began since the last acquisition: the next one is a refresh
        self._fence_retry_at = now
        self._fence_pending = False
        self.fence_holder: str | None = None
        self.grace_until = now  # after taking the fence from another group: no marks before this
        self.force_remark = False
        self._fence_release_owed = False  # handoff_by_fence: the term ended with records in flight
        self._handoff_since: float | None = None  # blocked by a leader of our own group since then
        self._holder_same_group = False

    @property
    def leading(self) -> bool:
        """Assigned partition 0 and seeing its own heartbeats: allowed to publish (fence permitting)."""
        return self.assigned and not self.fenced and not self.stopping

    @property
    def handing_over(self) -> bool:
        """Blocked only by the shard's previous leader of this group, while it settles."""
        return self.phase is Phase.BLOCKED and self._holder_same_group

    @property
    def active(self) -> bool:
        return self.phase is Phase.ACTIVE

    # -- time -----------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        limits = self.limits
        if self.assigned and not self.fenced and now >= self._heartbeat_seen_at + limits.heartbeat_timeout:
            # Kafka may hand partition 0 to another replica before this one hears of it; stop
            # sending well before that could happen (its session timeout is 3x this).
            log.warning("Fenced: no own heartbeat for %.1fs", now - self._heartbeat_seen_at)
            self.fenced = True
            self._end_term(events.LeaderFenced(), abort=True)
        if self.watching_queue and now - self._last_poll > limits.max_poll_interval:
            log.warning("Poll deadline exceeded (%.1fs without polling the leader topic); re-marking",
                        now - self._last_poll)
            self.remark()

    @property
    def watching_queue(self) -> bool:
        """A marked record waiting longer than queue_timeout to be sent re-marks the term (queue_timed_out)."""
        return self.phase is Phase.ACTIVE and not self.force_remark

    def queue_timed_out(self) -> None:
        log.warning("Queue timeout: a marked record waited more than %.1fs to be sent; re-marking",
                    self.limits.queue_timeout)
        self.remark()

    def deadline(self, deadline: float) -> float:
        if self.assigned and not self.fenced:
            deadline = min(deadline, self._heartbeat_seen_at + self.limits.heartbeat_timeout)
        if self.phase in (Phase.FENCING, Phase.BLOCKED) and not self._fence_pending:
            deadline = min(deadline, self._fence_retry_at)
        if self._release_at is not None:
            deadline = min(deadline, self._release_at)
        if self._stop_at is not None and not self.finished:
            deadline = min(deadline, self._stop_at)
        return deadline

    # -- leader election ------------------------------------------------------------------------

    def on_polled(self, heartbeat_seen: bool) -> None:
        self._last_poll = self.core.now
        if heartbeat_seen:
            self.on_heartbeat_seen()

    def on_assigned(self) -> None:
        if self.assigned:
            return
        log.info("Assigned %s: leading", self.core.leads)
        self.assigned = True
        self.fenced = False
        self._acquired = False
        self._heartbeat_seen_at = self.core.now

    def on_heartbeat_seen(self) -> None:
        self._heartbeat_seen_at = self.core.now
        if self.assigned and self.fenced:
            log.info("Resumed leader status (own heartbeat received)")
            self.fenced = False
            self._acquired = False

    def on_revoked(self) -> None:
        """Kafka hands partition 0 on once the shell answers ReleasePartition, which the core asks
        for when what is in flight has settled (or after settle_timeout, having given it up)."""
        self._lose("revoked", abort=False)
        if self._release_at is None:
            self._release_at = self.core.now + self.limits.settle_timeout
            self._release_aborted = False

    def on_lost(self) -> None:
        self._lose("lost", abort=True)

    def _lose(self, how: str, *, abort: bool) -> None:
        if not self.assigned:
            return
        log.info("%s %s", self.core.leads[0].upper() + self.core.leads[1:], how)
        was_leading = self.leading
        self.assigned = False
        self.fenced = False
        self._end_term(events.LeaderRevoked() if was_leading or how == "lost" else None, abort=abort)

    def stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        self._stop_at = self.core.now + self.limits.settle_timeout
        self._end_term(None, abort=False)

    # -- the database fence -----------------------------------------------------------------------

    def on_fence(self, leader_id: uuid.UUID, taken: bool, holder: str | None, same_group: bool = False,
                 unsettled: str | None = None) -> None:
        if leader_id != self.leader_id or self.phase not in (Phase.FENCING, Phase.BLOCKED):
            return
        now = self.core.now
        self._fence_pending = False
        if taken:
            grace = self.limits.delivery_timeout + self.limits.heartbeat_timeout
            if self.fence_holder is not None and not self._holder_same_group:
                # Another group published until a moment ago: let its last records land first.
                log.warning("Database fence taken (it was held by %s); marking in %.1fs, once that replica's last "
                            "records have landed", self.fence_holder, grace)
                self.grace_until = now + grace
            elif unsettled is not None and self.core.handoff_by_fence:
                # The shard's previous leader did not settle: its fence went with its session (a crash, a dropped
                # connection), and what it had sent may still land.
                log.warning("Took %s from %s, which did not settle (its database session ended); marking in %.1fs, "
                            "once its last records have landed", self.core.leads, unsettled, grace)
                self.grace_until = now + grace
            self.fence_holder = None
            self._handoff_since = None
            self._holder_same_group = False
            self._activate()
            return
        if same_group and self.core.handoff_by_fence:
            # The shard's previous leader settles what it has in flight, then lets the fence go.
            if self._handoff_since is None:
                log.info("Waiting for the shard's previous leader to settle: %s", holder)
                self._handoff_since = now
            self.fence_holder, self._holder_same_group = holder or "unknown", True
            self.phase = Phase.BLOCKED
            self._fence_retry_at = now + HANDOFF_RETRY
            return
        if holder != self.fence_holder:
            log.error("Leading the group, but another replica holds this table's database fence (%s): "
                      "marking nothing until it is released", holder)
            self.core.announce(events.LeaderBlocked(holder or "unknown"))
        self.fence_holder, self._holder_same_group = holder or "unknown", False
        self.phase = Phase.BLOCKED
        self._fence_retry_at = now + self.limits.fence_retry_interval

    def on_fence_failed(self, leader_id: uuid.UUID, error: str) -> None:
        if leader_id != self.leader_id:
            return
        self._fence_pending = False
        log.warning("Could not take the database fence, retrying in %.1fs: %s", self.limits.io_error_backoff, error)
        self._fence_retry_at = self.core.now + self.limits.io_error_backoff

    def fence_lost(self) -> None:
        """The fence session ended (a dropped connection, or another leader ended it): someone else
        may mark now, so send nothing more (what is in flight is given up); a new term takes the fence again first."""
        if self.phase in (Phase.ACTIVE, Phase.DRAINING) and not self.stopping:
            log.error("Lost the database fence (its session ended, or a pooler in transaction mode moved it: the "
                      "harvester needs a direct or session-pooled connection): stopped sending; taking it again")
            self.core.abort("the database fence was lost")
            self.remark()
            self.phase = Phase.DRAINING

    # -- terms ----------------------------------------------------------------------------------

    def advance(self) -> None:
        """Settle a revoke or a stop; start, fence or refresh a term."""
        core = self.core
        if self._fence_release_owed and not core.in_flight and not core.restarting_producer:
            self._fence_release_owed = False
            core.command(cmd.ReleaseFence())
        if self._release_at is not None:
            self._settle_revoke()
        if self.stopping and not self.finished:
            self._settle_stop()
        quiet = not core.in_flight and not core.restarting_producer
        if self.phase is Phase.IDLE and self.leading and quiet:
            self._begin_term()
        elif self.phase in (Phase.FENCING, Phase.BLOCKED) and not self._fence_pending \
                and core.now >= self._fence_retry_at:
            self._fence_pending = True
            core.command(cmd.TakeFence(self.leader_id, end_stale=self._end_stale()))
        elif self.phase is Phase.DRAINING and quiet:
            self._begin_term()  # a refresh: a new leader id re-marks what is left

    def _settle_revoke(self) -> None:
        core = self.core
        if not core.in_flight:
            self._release_at = None
            core.command(cmd.ReleasePartition())
        elif core.now >= self._release_at:
            if not self._release_aborted:
                self._release_aborted = True
                self._release_at = core.now + REVOKE_GRACE
                core.abort(f"{core.leads} was revoked")
            else:
                log.warning("Letting %s go with %d record(s) unsettled", core.leads, core.in_flight)
                self._release_at = None
                self._give_up_fence()
                core.command(cmd.ReleasePartition())

    def _settle_stop(self) -> None:
        core = self.core
        if not core.in_flight:
            self.finished = True
        elif core.now >= self._stop_at:
            if not self._stop_aborted:
                self._stop_aborted = True
                self._stop_at = core.now + STOP_GRACE
                core.abort("stopping")
            else:
                log.warning("Stopping with %d record(s) unsettled; the next leader re-marks them", core.in_flight)
                self._give_up_fence()
                self.finished = True

    def _give_up_fence(self) -> None:
        """Records are given up unsettled: a fence still owed goes now (the next leader of the shard has
        waited as long as a settle can take, and would end this session next)."""
        if self._fence_release_owed:
            self._fence_release_owed = False
            self.core.command(cmd.ReleaseFence(settled=False))

    def _end_stale(self) -> bool:
        """Whether a holder of our own group may be ended as stale: always, unless a shard's previous
        leader may still be settling (for as long as a settle can take)."""
        if not self.core.handoff_by_fence or self._handoff_since is None:
            return not self.core.handoff_by_fence
        return self.core.now >= self._handoff_since + self.limits.settle_timeout + REVOKE_GRACE + STOP_GRACE

    def _begin_term(self) -> None:
        self.leader_id = self._new_leader_id()  # fresh at every acquisition and refresh, never reused
        self.phase = Phase.FENCING
        self._fence_pending = True
        self._handoff_since = None
        self.core.command(cmd.TakeFence(self.leader_id, end_stale=self._end_stale()))

    def _activate(self) -> None:
        self.last_term_id = self.leader_id
        refreshed = self._acquired
        self._acquired = True
        self.phase = Phase.ACTIVE
        self.force_remark = False
        if refreshed:
            log.warning("Refreshed leader id: %s", self.leader_id)
            self.core.announce(events.LeaderRefreshed(self.leader_id))
        else:
            log.info("Leading with leader id %s", self.leader_id)
            self.core.announce(events.LeaderAcquired(self.leader_id))

    def remark(self) -> None:
        """Stop sending; once nothing is in flight, a new leader id re-marks everything (goharvest A9)."""
        self.force_remark = True
        self.core.abandon_queued()
        if self.phase is Phase.ACTIVE:
            self.phase = Phase.DRAINING

    def _end_term(self, event: events.Event | None, *, abort: bool) -> None:
        """Leadership is gone (or going): drop what is queued; what is in flight settles by itself."""
        core = self.core
        had_term = self.phase is not Phase.IDLE
        core.abandon_queued()
        self.phase = Phase.IDLE
        self.leader_id = None
        self.force_remark = False
        self._fence_pending = False
        self.fence_holder = None
        self._holder_same_group = False
        self._handoff_since = None
        if had_term and core.handoff_by_fence and (core.in_flight or core.restarting_producer):
            self._fence_release_owed = True  # the next leader of the shard waits for it: let it go once settled
        elif had_term:
            core.command(cmd.ReleaseFence())
        if abort:
            core.abort("leadership lost")
        if event is not None:
            core.announce(event)
