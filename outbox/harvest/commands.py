"""What the core asks its shell to do, and how the shell describes a failed delivery to it.

The core (core.py) never touches a socket: it answers inputs with these commands, and the shell
(harvester.py in production, the simulator in tests) carries them out and reports the outcome
back as further inputs.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from outbox.harvest import events
from outbox.harvest.contract import Record


@dataclass(frozen=True, slots=True)
class DeliveryError:
    """A failed delivery, as the core needs to know it (the shell translates Kafka's errors)."""

    code: str
    message: str
    #: It will fail the same way if retried (too large, not authorised, ...).
    permanent: bool = False
    #: The producer cannot go on: every record in it has failed, and it must be replaced.
    fatal: bool = False

    def __str__(self) -> str:
        return self.message or self.code


# -- database ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TakeFence:
    """Take (or confirm) the table's database fence; answer on_fence()."""

    leader_id: uuid.UUID
    #: End the session of a holder of our own group (a stale leader) and take the fence.
    end_stale: bool = True


@dataclass(frozen=True, slots=True)
class ReleaseFence:
    """Give the fence up (revoked, fenced, stopping)."""

    #: Nothing of this leader's is in flight (a shard's successor need not wait for stragglers); False when
    #: records were given up unsettled.
    settled: bool = True


@dataclass(frozen=True, slots=True)
class Mark:
    """Read up to `limit` rows with id > after, and the visible rows of the `gaps` (id ranges, lowest
    first), for the term of `leader_id`; answer on_marked() (with the outbox's writers seen just
    before, read only when there are gaps) or on_mark_failed(). Marking writes nothing: the term
    keeps what it has read in memory.
    """

    leader_id: uuid.UUID
    limit: int
    after: int
    gaps: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class Purge:
    """Delete rows whose records Kafka acknowledged; answer on_purged().

    With `fenced`, also tell whether this replica's fence session still holds the fence (without, the
    store does not read it: contract.PURGE_UNFENCED). Without `durable`, the purge may answer before
    the server flushed it (Postgres' asynchronous commit): a crash of the database server can then
    undo it, and the records are published again (Settling.purges_durable says when that is allowed).
    """

    ids: tuple[int, ...]
    fenced: bool = False
    durable: bool = True


@dataclass(frozen=True, slots=True)
class Reset:
    """Rows whose delivery failed: count the failure where the table can; answer on_reset() (with
    `fenced`, whether the fence is still held). The next term reads them again."""

    ids: tuple[int, ...]
    errors: tuple[str, ...]
    fenced: bool = False


@dataclass(frozen=True, slots=True)
class Hold:
    """Note on a poison row why it is held; answer on_held() with the row's version after it."""

    record_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class CheckHeld:
    """Read the held rows as they are now; answer on_held_checked()."""

    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Park:
    """Move a poison row, as the version that failed (`record.version`), to the dead-letter table (and
    topic, if configured); answer on_parked()."""

    record: Record
    reason: str
    attempts: int


# -- Kafka ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Send:
    """Produce these records, in this order; each is answered by on_delivered() (or on_refused())."""

    records: tuple[Record, ...]


@dataclass(frozen=True, slots=True)
class AbortSends:
    """Drop whatever the producer has not delivered yet (each is reported failed) and send no more of it."""

    reason: str


@dataclass(frozen=True, slots=True)
class RestartProducer:
    """Replace the record producer (after a fatal error); answer on_producer_restarted()."""


# -- leader election --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ReleasePartition:
    """Let Kafka hand partition 0 to another replica: the answer to on_revoked(), given once what was in
    flight has settled (or was given up), so the next leader never sends it again."""


# -- telling the world --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Announce:
    """An event for the shell's on_event callback (and so Django's signals)."""

    event: events.Event


Command = (TakeFence | ReleaseFence | Mark | Purge | Reset | Hold | CheckHeld | Park | Send | AbortSends
           | RestartProducer | ReleasePartition | Announce)
