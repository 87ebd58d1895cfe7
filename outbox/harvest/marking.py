"""The core's marks: which rows a term reads next, and the gaps it must not skip.

Marking is reading: a term reads the rows above the highest id it has read (its high water), in id
order, and keeps what it has read in memory; a new term starts again from the table's head.

An id is taken (nextval) before its row is written, and rows commit out of id order, so a mark may
see id 12 before id 11 commits. Skipping 11 would lose it, so every id below the high water that
was not visible when read is a *gap*, looked up again (by primary key, with the next rows) at every
mark until it appears. A gap is forgotten only when it can no longer appear: once every transaction
that was writing to the outbox when it was recorded has ended, and a lookup after that did not find
it (it rolled back). Those writers are the transactions holding a row-exclusive lock on the outbox
table, read from pg_locks with every mark. Only the outbox's own writers count: an unrelated old
transaction (a report, an idle session, a replica's hot_standby_feedback) holds back nothing here.

Per-key order survives late rows because writers of a key are causal (the next record of a key is
written after the last one committed): a gap's row is never behind a later row of its key that is
visible already, and rows are taken in id order, gaps first.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from outbox.harvest import commands as cmd
from outbox.harvest.contract import Record

if TYPE_CHECKING:
    from outbox.harvest.core import Core

log = logging.getLogger("outbox.harvest")

#: Gap ranges looked up by one mark, at most. Beyond it, marks read only gaps (lowest first) until
#: there are fewer: a row in a gap not looked up could be behind a newer row of its key.
MAX_GAP_RANGES = 10_000


@dataclass(slots=True)
class Gap:
    """Ids lo..hi, not visible when a mark read past them."""

    lo: int
    hi: int
    #: The outbox's writers seen with the first mark after the gap was recorded (None: not yet).
    watch: frozenset[str] | None = None
    #: The mark (its sequence number) that read `watch`: only a lookup by a later mark can forget the gap.
    watched_at: int = 0


class Marking:
    """One term's high water and gaps; reset at every term's start."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.limits = core.limits
        self.listening = False
        self.pending: cmd.Mark | None = None
        self.next_mark_at = core.now
        self.grace_until = core.now  # Leadership.on_fence: no marks before this
        self._notified = False
        self.high_water = 0  # the highest id this term has read
        self.gaps: list[Gap] = []  # sorted by id, disjoint
        self._marks = 0  # marks answered this term

    def begin(self, grace_until: float) -> None:
        """A term begins: its marks start from the table's head, not before `grace_until` (Leadership.on_fence: the
        fence's last holder, of another group or unsettled, may still have records landing). A term's end needs no
        call: marks are asked for only while a term is active, and the next term begins here."""
        self.high_water = 0
        self.gaps = []
        self._marks = 0
        self.next_mark_at = self.core.now
        self.grace_until = grace_until
        self.pending = None

    def notified(self) -> None:
        self._notified = True

    def wants_records(self, queued: int, remarking: bool) -> bool:
        """Mark more only while few records wait (`queued` of them, not counting those behind a held record):
        memory stays bounded and marks stay cheap; and not while the term is being re-marked."""
        return not remarking and queued < self.limits.mark_query_records

    def deadline(self, deadline: float, queued: int, remarking: bool) -> float:
        if self.pending is None and self.wants_records(queued, remarking):
            deadline = min(deadline, max(self.grace_until, self.next_mark_at))
        return deadline

    def mark(self, term: uuid.UUID, queued: int, remarking: bool) -> None:
        """Ask for the next rows for the active term `term`, when due."""
        core = self.core
        if self.pending is not None or not self.wants_records(queued, remarking) or core.now < self.grace_until:
            return
        if not (self._notified or core.now >= self.next_mark_at):
            return
        self._notified = False
        gaps = tuple((gap.lo, gap.hi) for gap in self.gaps[:MAX_GAP_RANGES])
        self.pending = cmd.Mark(term, self.limits.mark_query_records, after=self.high_water, gaps=gaps)
        core.command(self.pending)

    def marked(self, mark: cmd.Mark, records: list[Record], writers: frozenset[str] | None,
               term: uuid.UUID | None) -> list[Record] | None:
        """A mark's answer: the rows it read (sorted by id) and the outbox's writers seen just before
        (None: not read, which the store does only for a mark without gaps: then no gap is watched or forgotten).
        `term` is the active term's leader id (None: no term is active).
        Returns the rows the term takes, in id order; None if the mark belongs to a term that is over."""
        core = self.core
        if mark is self.pending:
            self.pending = None
        if term is None or mark.leader_id != term:
            return None
        self._marks += 1
        limit = mark.limit
        found = [r for r in records if r.id <= mark.after]
        new = [r for r in records if r.id > mark.after]
        looked_upto = mark.gaps[-1][1] if mark.gaps else mark.after
        if len(found) >= limit:
            # The gaps alone filled the mark: take those, the lowest visible rows, and nothing above them.
            looked_upto = found[-1].id
            new = []
        elif len(self.gaps) > len(mark.gaps):
            # Not every gap was looked up: a row in one of the others could be behind a new row of its key.
            new = []
        self._resolve(mark.gaps, found, looked_upto, writers)
        if new:
            self._record_gaps(mark.after, new)
            self.high_water = max(self.high_water, new[-1].id)
        if len(new) < limit and len(found) < limit:
            # Everything visible is read: wait for a NOTIFY, or look again later.
            self.next_mark_at = core.now + (self.limits.idle_poll_interval if self.listening
                                            else self.limits.mark_backoff)
        return found + new

    def mark_failed(self, mark: cmd.Mark, error: str, term: uuid.UUID | None) -> bool:
        """A Mark raised: True if its term (`term`, the active one) must start again from the head (what it read
        is unknown)."""
        if mark is self.pending:
            self.pending = None
        log.warning("Mark query failed, re-marking after %.1fs: %s", self.limits.io_error_backoff, error)
        self.next_mark_at = self.core.now + self.limits.io_error_backoff
        return term is not None and mark.leader_id == term

    def _record_gaps(self, after: int, rows: list[Record]) -> None:
        """Ids between the last high water and the rows read that were not among them."""
        previous = max(after, self.high_water)
        for record in rows:
            if record.id > previous + 1:
                self.gaps.append(Gap(previous + 1, record.id - 1))
            previous = max(previous, record.id)

    def _resolve(self, looked: tuple[tuple[int, int], ...], found: list[Record], upto: int,
                 writers: frozenset[str] | None) -> None:
        """Gaps after a lookup of `looked` (up to id `upto`) that found `found`: ids found leave the
        gaps; a gap whose writers have all ended since it was watched, looked up now and not found, is
        forgotten; a gap not watched yet is watched with the writers seen now. Without the writers (None)
        nothing is watched or forgotten: only found ids leave the gaps."""
        present = {record.id for record in found}
        looked_ids = {(lo, hi) for lo, hi in looked}
        kept: list[Gap] = []
        for gap in self.gaps:
            was_looked = (gap.lo, gap.hi) in looked_ids and gap.lo <= upto
            if was_looked and writers is not None and gap.watch is not None and gap.watched_at < self._marks \
                    and not (gap.watch & writers):
                # Its writers have all ended, and this lookup came after: what is not here never will be.
                covered_hi = min(gap.hi, upto)
                if covered_hi < gap.hi:
                    kept.append(Gap(covered_hi + 1, gap.hi, gap.watch, gap.watched_at))
                continue
            if gap.watch is None and writers is not None:
                gap.watch, gap.watched_at = writers, self._marks
            if was_looked and present:
                kept.extend(_split(gap, present, min(gap.hi, upto)))
            else:
                kept.append(gap)
        self.gaps = kept


def _split(gap: Gap, present: set[int], upto: int) -> list[Gap]:
    """The gap without the ids found in it (only ids up to `upto` were looked up)."""
    pieces: list[Gap] = []
    start = gap.lo
    for record_id in sorted(i for i in present if gap.lo <= i <= upto):
        if record_id > start:
            pieces.append(Gap(start, record_id - 1, gap.watch, gap.watched_at))
        start = record_id + 1
    if start <= gap.hi:
        pieces.append(Gap(start, gap.hi, gap.watch, gap.watched_at))
    return pieces
