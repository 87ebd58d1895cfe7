"""The core's marks: when to mark, from where, and the watermark below which nothing can still appear.

Marks walk up from the watermark, past this term's own marked rows; a rescan walks the region below
it now and then, in chunks, for rows that came back some other way (an operator's requeue). Marks
stop while enough records wait to be sent (memory stays bounded and marks stay cheap), and an idle
leader marks again on a NOTIFY, or every idle_poll_interval (mark_backoff without LISTEN).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from outbox.harvest import commands as cmd
from outbox.harvest.contract import Record

if TYPE_CHECKING:
    from outbox.harvest.core import Core

log = logging.getLogger("outbox.harvest")

#: How long an INSERT may take between taking its id (nextval) and writing its row (when its
#: transaction gets an xid). The watermark waits this long before trusting a snapshot.
SETTLE_DELAY = 1.0


class Marking:
    """One term's marks and watermark; reset at every term's start."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.limits = core.limits
        now = core.now
        self.listening = False
        self.pending: cmd.Mark | None = None
        self.next_mark_at = now
        self._notified = False
        self._high_water = 0  # the highest id this term has marked
        self.watermark = 0  # every id at or below is settled and was seen by this term's marks
        self._samples: deque[tuple[float, int, int]] = deque()  # (time, high water, snapshot xmax) per mark
        self._next_rescan_at = now
        self._rescan_from: int | None = None  # a rescan under way continues after this id

    def begin(self) -> None:
        """A term begins: its marks start from the table's head."""
        now = self.core.now
        self._high_water = 0
        self.watermark = 0
        self._samples.clear()
        self._rescan_from = None
        self._next_rescan_at = now + self.limits.rescan_interval
        self.next_mark_at = now
        self.pending = None

    def end(self) -> None:
        self.pending = None

    def notified(self) -> None:
        self._notified = True

    def wants_records(self) -> bool:
        """Mark more only while few records wait: memory stays bounded and marks stay cheap."""
        return not self.core.leadership.force_remark and self.core.lanes.queued < self.limits.mark_query_records

    def deadline(self, deadline: float) -> float:
        if self.pending is None and self.wants_records():
            grace = self.core.leadership.grace_until
            deadline = min(deadline, max(grace, min(self.next_mark_at, self._next_rescan_at)))
        return deadline

    def mark(self) -> None:
        core = self.core
        now = core.now
        if self.pending is not None or not self.wants_records() or now < core.leadership.grace_until:
            return
        limit = self.limits.mark_query_records
        if not self.watermark and now >= self._next_rescan_at:
            self._next_rescan_at = now + self.limits.rescan_interval  # nothing below the marks yet
        if self._rescan_from is not None or (self.watermark and now >= self._next_rescan_at):
            after = self._rescan_from or 0
            self._rescan_from = after
            mark = cmd.Mark(core.leadership.leader_id, limit, after=after, upto=self.watermark)
        elif self._notified or now >= self.next_mark_at:
            mark = cmd.Mark(core.leadership.leader_id, limit, after=self.watermark)
        else:
            return
        self._notified = False
        self.pending = mark
        core.command(mark)

    def marked(self, mark: cmd.Mark, records: list[Record], snapshot: tuple[int, int] | None) -> bool:
        """A mark's answer; False if it belongs to a term that is over (the next term re-marks its rows)."""
        core = self.core
        if mark is self.pending:
            self.pending = None
        if mark.leader_id != core.leadership.leader_id or not core.leadership.active:
            return False
        limits = self.limits
        full = len(records) >= mark.limit
        if mark.rescan:
            self._rescan_from = records[-1].id if full else None
            if not full:
                self._next_rescan_at = core.now + limits.rescan_interval
        else:
            if records:
                self._high_water = max(self._high_water, records[-1].id)
            if snapshot is not None:
                self._advance_watermark(snapshot, covered=records[-1].id if full else None)
            if not full:
                # Everything visible is marked: wait for a NOTIFY, or look again later.
                self.next_mark_at = core.now + (limits.idle_poll_interval if self.listening else limits.mark_backoff)
        return True

    def mark_failed(self, mark: cmd.Mark, error: str) -> bool:
        """A Mark raised: True if the term that sent it must re-mark (its UPDATE may have committed)."""
        core = self.core
        if mark is self.pending:
            self.pending = None
        log.warning("Mark query failed, re-marking after %.1fs: %s", self.limits.io_error_backoff, error)
        self.next_mark_at = core.now + self.limits.io_error_backoff
        return mark.leader_id == core.leadership.leader_id and core.leadership.active

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
        samples.append((self.core.now, self._high_water, xmax))
        best = self.watermark
        while len(samples) > 1:
            taken, high_water, _ = samples[0]
            later = next((s for s in samples if s[0] >= taken + SETTLE_DELAY), None)
            if later is None or xmin < later[2]:
                break
            best = max(best, high_water)
            samples.popleft()
        if covered is not None:
            best = min(best, covered)
        self.watermark = max(self.watermark, best)
