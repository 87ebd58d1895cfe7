"""The records waiting to settle: acknowledged ones to purge, failed ones to reset, batched per statement.

Lanes (lanes.py) decide which records are ready to settle and what settling them frees; this module batches
them and says how each batch runs: one Purge and one Reset at most under way, a failed one retried after
io_error_backoff, purges nothing waits on held back up to purge_delay so that many go in one statement
(`purge_due`), whether a purge reads the fence (`purge_reads_fence`) and must be on disk before it answers
(`purges_durable`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from outbox.harvest import commands as cmd
from outbox.harvest.config import Limits

if TYPE_CHECKING:
    from outbox.harvest.lanes import Entry

log = logging.getLogger("outbox.harvest")


class Batch:
    """One kind of settling statement's records: those queued, the batch under way (one at most), and when a
    failed batch may go again (its records go back to the front of the queue, in their order)."""

    def __init__(self, kind: str, now: float) -> None:
        self.kind = kind
        self.queued: list[Entry] = []
        self.under_way: list[Entry] | None = None
        self.retry_at = now

    def waiting(self) -> bool:
        """Records are queued and no batch is under way."""
        return bool(self.queued) and self.under_way is None

    def start(self) -> list[Entry]:
        self.under_way, self.queued = self.queued, []
        return self.under_way

    def done(self) -> list[Entry]:
        """The batch under way committed: its records, to settle."""
        under_way, self.under_way = self.under_way or [], None
        return under_way

    def failed(self, now: float, backoff: float, error: str) -> None:
        log.warning("%s of %d record(s) failed, retrying in %.1fs: %s", self.kind, len(self.under_way or ()),
                    backoff, error)
        self.queued[:0] = self.under_way or []
        self.under_way = None
        self.retry_at = now + backoff


class Settling:
    """The purge and reset batches, and when the next purge may go."""

    def __init__(self, limits: Limits, now: float) -> None:
        self.limits = limits
        self.purge = Batch("Purge", now)
        self.reset = Batch("Reset", now)
        self._next_purge_at = now  # purges are coalesced: one at most every purge_interval
        self._to_purge_since = now  # when the oldest queued purge was queued (purge_delay counts from it)
        #: A mark succeeded since the last purge was issued: the fence session held the fence then, so
        #: the next purge need not read it if nothing waits on it (contract.PURGE_UNFENCED). Set by
        #: Core.on_marked.
        self.mark_saw_fence = False

    @property
    def to_reset(self) -> list[Entry]:
        return self.reset.queued

    def queue_purge(self, entry: Entry, now: float) -> None:
        if not self.purge.queued:
            self._to_purge_since = now
        self.purge.queued.append(entry)

    def queue_reset(self, entry: Entry) -> None:
        self.reset.queued.append(entry)

    def deadline(self, deadline: float, active: bool, settle_wanted: bool) -> float:
        if self.purge.waiting():
            deadline = min(deadline, self.purge_due(active, settle_wanted))
        if self.reset.waiting():
            deadline = min(deadline, self.reset.retry_at)
        return deadline

    def purge_due(self, active: bool, settle_wanted: bool) -> float:
        """When the records to purge go. At a steady rate nothing waits on most acknowledged records
        (a key's next record goes out before its last is purged, up to max_in_flight_per_key): while
        the term is active and nothing waits (`settle_wanted` False), they are purged together after
        purge_delay, which costs the database one statement for many records instead of one for each wake."""
        due = max(self.purge.retry_at, self._next_purge_at)
        if active and not settle_wanted and len(self.purge.queued) < self.limits.mark_query_records:
            due = max(due, self._to_purge_since + self.limits.purge_delay)
        return due

    def purge_reads_fence(self, settle_wanted: bool) -> bool:
        """Whether the next purge reads the fence. It must before a purge that frees what waits to be
        sent (`settle_wanted`: a key's slot, the throttle, a solo record): the next send must follow a purge
        that ran while the fence was held. A purge nothing waits on leads to no send: it need not if a mark
        succeeded since the last purge (the mark ran on the fence session while that held the fence;
        a mark on an ended session fails, and the term starts again)."""
        return settle_wanted or not self.mark_saw_fence

    def purges_durable(self) -> bool:
        """Whether a purge must be on disk before it answers. With one record per key in flight it must:
        its answer lowers the key's barrier, and a purge a database crash undid would publish the record
        again after the key's next one (R0 R1 R0). With several in flight, a key's later records may go
        out before its earlier ones are purged anyway, and a crash of the harvester can then publish
        them again (R0 R1 R0 R1, repeats DESIGN.md allows); a purge undone by a crash of the database
        does no more than that. Not waiting for the flush spares the server a WAL flush a purge."""
        return self.limits.max_in_flight_per_key == 1

    def flush(self, now: float, fenced: bool, active: bool, settle_wanted: bool) -> list[cmd.Command]:
        """The Purge and Reset due now; `fenced`: each also checks that the fence is still held (a purge
        nothing waits on not when a mark saw it since the last purge); `active`: the term is active (not
        draining, revoked or stopping), so purges may wait (purge_due)."""
        commands: list[cmd.Command] = []
        if self.purge.waiting() and now >= self.purge_due(active, settle_wanted):
            self._next_purge_at = now + self.limits.purge_interval
            read_fence = fenced and self.purge_reads_fence(settle_wanted)
            self.mark_saw_fence = False
            ids = tuple(e.record.id for e in self.purge.start())
            commands.append(cmd.Purge(ids, read_fence, self.purges_durable()))
        if self.reset.waiting() and now >= self.reset.retry_at:
            entries = self.reset.start()
            commands.append(cmd.Reset(tuple(e.record.id for e in entries), tuple(str(e.error) for e in entries),
                                      fenced))
        return commands

    def purge_failed(self, now: float, error: str) -> None:
        self.purge.failed(now, self.limits.io_error_backoff, error)
        self._to_purge_since = now - self.limits.purge_delay  # retried at the batch's retry_at
