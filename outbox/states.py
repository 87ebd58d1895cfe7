"""Every state an outbox record can be in, defined once.

The dashboard, the records changelist (its state column and filter), the health probe and the
metrics all decide a record's state here, from the same facts: the live replicas' status rows
(who leads under which leader id, and which records it holds) and two settings, `stuck_after`
and `stuck_reset_count`. A record is in exactly one state; the first that applies wins:

    held       a live leader holds it: it failed on its own (reason, attempts, since when)
    behind     a later record of a held key: it waits behind held record #N
    stuck      waiting or in flight longer than `stuck_after`, or failed `stuck_reset_count` times
    in flight  read by a live leader (sent, or queued to be sent): at or below its status row's
               `marked_upto`
    waiting    not read by a live leader yet: new, or left by a leader that is gone
    parked     moved to the dead-letter table (it is no longer in the outbox)

`Facts.state_of()` classifies one row in Python and `Facts.where()` selects the rows of a state
in SQL; both are built from the same conditions, and a test holds them to each other.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import reduce
from operator import or_

import psycopg
from django.db import DatabaseError, connections, models
from django.db.models import Q
from django.utils import timezone
from django.utils.timesince import timesince

from outbox import conf, many
from outbox.harvest.replicas import Replicas
from outbox.models import DeadLetter, HarvesterStatus, OutboxRecord
from outbox.reasons import first_line

#: Counts of a table are exact up to this many rows, then Postgres's live-row estimate.
COUNT_LIMIT = 10_000


class RecordState(enum.StrEnum):
    """The states, in the order they are decided (parked rows are not in the outbox table)."""

    HELD = "held"
    BEHIND = "behind"
    STUCK = "stuck"
    IN_FLIGHT = "in_flight"
    WAITING = "waiting"
    PARKED = "parked"

    @property
    def label(self) -> str:
        return {"in_flight": "in flight", "behind": "waiting behind"}.get(self.value, self.value)


#: The states a row of the outbox table can be in (the records filter offers these).
OUTBOX_STATES = (RecordState.WAITING, RecordState.IN_FLIGHT, RecordState.HELD, RecordState.BEHIND,
                 RecordState.STUCK)


@dataclass(frozen=True)
class Held:
    """A held record, as the live leader holding it reports it in its status row (`held`)."""

    id: int
    key: str
    topic: str
    reason: str
    #: Times it failed on its own under this leadership.
    attempts: int
    #: When it was first held (the status row's `held_for`, counted back from when it was written).
    since: datetime
    #: Records of its key the leader has marked and keeps waiting behind it...
    behind: int
    #: ...and whether more wait in the table beyond those.
    more_behind: bool
    #: The replica holding it, and the leader id of its term.
    replica: str
    leader_id: uuid.UUID

    @property
    def behind_text(self) -> str:
        if self.more_behind:
            return f"{self.behind}, and more in the table"
        return str(self.behind)


def replicas(using: str | None = None, now: datetime | None = None) -> Replicas:
    """Read the status rows; a replica not seen for `status_gone_after` seconds is gone."""
    now = now or timezone.now()
    rows = list(HarvesterStatus.objects.using(using or conf.database_alias()).order_by("name"))
    return Replicas.sort(rows, now, float(conf.setting("status_gone_after")), table=OutboxRecord._meta.db_table)


def elsewhere(now: datetime) -> tuple[list[tuple[str, Replicas]], list[str]]:
    """The status rows in the other databases OUTBOX["outboxes"] names, by alias (an engine writes its row in its
    own outbox's database), and a line for each that could not be read. A database without the status table (status
    rows off there) has none."""
    found, unread = [], []
    for alias in many.database_aliases()[1:]:
        try:
            found.append((alias, replicas(alias, now)))
        except DatabaseError as error:
            if not isinstance(error.__cause__, psycopg.errors.UndefinedTable):
                unread.append(f"cannot read the status rows in database {alias!r}: {first_line(error)}")
    return found, unread


def everywhere(facts: Facts) -> tuple[Replicas, list[str]]:
    """The replicas of `facts`' database and of the others OUTBOX["outboxes"] names (elsewhere()), each of those
    tables named with its database (`outbox (database 'billing')`): they are other outboxes, even where their table
    has this one's name. And a line for each database that could not be read."""
    found, unread = elsewhere(facts.now)
    rows = list(facts.replicas.rows)
    for alias, others in found:
        for row in others.rows:
            row.harvested_table = f"{row.harvested_table} (database {alias!r})"
            rows.append(row)
    return Replicas.sort(rows, facts.now, float(conf.setting("status_gone_after")), table=facts.replicas.table), unread


@dataclass(frozen=True)
class Verdict:
    """One record's state, and one line saying why."""

    state: RecordState
    why: str
    #: The held record, for held and behind records.
    held: Held | None = None

    @property
    def label(self) -> str:
        if self.state is RecordState.BEHIND and self.held is not None:
            return f"waiting behind #{self.held.id}"
        return self.state.label


@dataclass(frozen=True)
class Facts:
    """What states are decided from, read once per page, probe or scrape."""

    now: datetime
    replicas: Replicas
    stuck_after: float
    stuck_reset_count: int
    #: Held records by id, and by key (a key has at most one).
    held: dict[int, Held] = field(default_factory=dict)

    @property
    def held_by_key(self) -> dict[str, Held]:
        return {h.key: h for h in self.held.values()}

    @classmethod
    def read(cls, using: str | None = None) -> Facts:
        """The live replicas, their held records whose rows are still in the outbox, and the settings."""
        using = using or conf.database_alias()
        now = timezone.now()
        found = replicas(using, now)
        held: dict[int, Held] = {}
        for leader in found.own_leaders:
            for entry in leader.held or []:
                held.setdefault(int(entry["id"]), Held(
                    id=int(entry["id"]), key=entry["key"], topic=entry.get("topic", ""), reason=entry["reason"],
                    attempts=int(entry.get("attempts", 0)),
                    since=leader.last_seen - timedelta(seconds=float(entry.get("held_for", 0))),
                    behind=int(entry.get("behind", 0)), more_behind=bool(entry.get("more_behind")),
                    replica=leader.name, leader_id=leader.leader_id))
        if held:
            # The leader notices a deleted or parked held row within a second or so; the page
            # should not wait for its next status row to stop calling it held.
            present = set(OutboxRecord.objects.using(using).filter(id__in=list(held)).values_list("id", flat=True))
            held = {i: h for i, h in held.items() if i in present}
        return cls(now=now, replicas=found, stuck_after=float(conf.setting("stuck_after")),
                   stuck_reset_count=int(conf.setting("stuck_reset_count")), held=held)

    # -- one row ----------------------------------------------------------------------------------

    def state_of(self, record: OutboxRecord) -> Verdict:
        """The state of one outbox row."""
        held = self.held.get(record.id)
        if held is not None:
            return Verdict(RecordState.HELD, f"held: {held.reason} ({held.attempts} attempt(s), for "
                                             f"{timesince(held.since, self.now)})", held)
        held = self.held_by_key.get(record.kafka_key)
        if held is not None and record.id > held.id:
            return Verdict(RecordState.BEHIND, f"its key waits behind held record #{held.id}", held)
        upto = self.replicas.marked_upto
        live = upto is not None and record.id <= upto
        reasons = []
        if record.create_time < self._old:
            written = timesince(record.create_time, self.now)
            reasons.append(f"{'in flight' if live else 'waiting'}, written {written} ago")
        if record.reset_count > 0 and record.reset_count >= self.stuck_reset_count:
            error = f": {record.last_error}" if record.last_error else ""
            reasons.append(f"delivery failed {record.reset_count} times{error}")
        if reasons:
            return Verdict(RecordState.STUCK, "; ".join(reasons))
        if live:
            return Verdict(RecordState.IN_FLIGHT, "read by the live leader")
        return Verdict(RecordState.WAITING, "not read by a live leader yet")

    # -- many rows --------------------------------------------------------------------------------

    def where(self, state: RecordState) -> Q:
        """The rows of the outbox in `state`, as a filter."""
        held, behind = self._held_q, self._behind_q
        stuck = Q(create_time__lt=self._old) | Q(reset_count__gt=0, reset_count__gte=self.stuck_reset_count)
        upto = self.replicas.marked_upto
        live = Q(id__lte=upto) if upto is not None else Q(pk__in=[])
        if state is RecordState.HELD:
            return held
        if state is RecordState.BEHIND:
            return behind & ~held
        if state is RecordState.STUCK:
            return stuck & ~held & ~behind
        if state is RecordState.IN_FLIGHT:
            return live & ~stuck & ~held & ~behind
        if state is RecordState.WAITING:
            return ~live & ~stuck & ~held & ~behind
        return Q(pk__in=[])  # parked rows are in the dead-letter table, not the outbox

    @property
    def _old(self) -> datetime:
        return self.now - timedelta(seconds=self.stuck_after)

    @property
    def _held_q(self) -> Q:
        return Q(id__in=list(self.held))

    @property
    def _behind_q(self) -> Q:
        # Rows are looked for by key only when something is held (rarely, and few keys at a time).
        return reduce(or_, (Q(kafka_key=h.key, id__gt=h.id) for h in self.held.values()), Q(pk__in=[]))


@dataclass(frozen=True)
class Count:
    """A count that is exact when small and Postgres's estimate when large."""

    value: int
    exact: bool

    def __str__(self) -> str:
        return f"{self.value:,}" if self.exact else f"about {self.value:,}"


def parked_count(using: str | None = None) -> Count:
    """Rows in the dead-letter table."""
    return bounded_count(DeadLetter, using)


def bounded_count(model: type[models.Model], using: str | None = None) -> Count:
    """A table's rows, without counting a big table row by row: exact up to COUNT_LIMIT (a bounded
    scan), beyond it Postgres's live-row estimate."""
    using = using or conf.database_alias()
    bounded = model.objects.using(using).all()[:COUNT_LIMIT + 1].count()
    if bounded <= COUNT_LIMIT:
        return Count(bounded, exact=True)
    return Count(max(bounded, table_estimate(model._meta.db_table, using) or 0), exact=False)


def table_estimate(table: str, using: str | None = None) -> int | None:
    """Postgres's live-row estimate for a table (its statistics: no scan), or None if it has none yet."""
    with connections[using or conf.database_alias()].cursor() as cursor:
        cursor.execute("SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = to_regclass(%s)", [table])
        row = cursor.fetchone()
    return int(row[0]) if row is not None else None
