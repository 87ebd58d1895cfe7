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


@dataclass(frozen=True, slots=True)
class ReleaseFence:
    """Give the fence up (revoked, fenced, stopping)."""


@dataclass(frozen=True, slots=True)
class Mark:
    """Mark up to `limit` rows for `leader_id`; answer on_marked() (with a snapshot's xmin and xmax
    taken just before) or on_mark_failed(). A normal mark takes rows with id > after; a rescan
    (upto set) takes rows with after < id <= upto.
    """

    leader_id: uuid.UUID
    limit: int
    after: int
    upto: int | None = None

    @property
    def rescan(self) -> bool:
        return self.upto is not None


@dataclass(frozen=True, slots=True)
class Purge:
    """Delete delivered rows, each guarded by the leader id it was marked under; answer on_purged().

    With `fenced`, also tell whether this replica's fence session still holds the fence.
    """

    items: tuple[tuple[int, uuid.UUID], ...]
    fenced: bool = False


@dataclass(frozen=True, slots=True)
class Reset:
    """Unmark rows whose delivery failed (guarded like Purge); answer on_reset()."""

    items: tuple[tuple[int, uuid.UUID], ...]
    errors: tuple[str, ...]
    fenced: bool = False


@dataclass(frozen=True, slots=True)
class Hold:
    """Note on a poison row why it is held; answer on_held() with the row's new version."""

    record_id: int
    leader_id: uuid.UUID
    reason: str


@dataclass(frozen=True, slots=True)
class CheckHeld:
    """Read the held rows as they are now; answer on_held_checked()."""

    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Park:
    """Move a poison row to the dead-letter table (and topic, if configured); answer on_parked()."""

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
