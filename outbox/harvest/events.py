"""Events a Harvester reports to its `on_event` callback (the Django layer turns them into signals)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class LeaderAcquired:
    """This replica leads: it owns partition 0 of the leader topic, sees its own heartbeats and holds the fence."""

    leader_id: uuid.UUID


@dataclass(frozen=True)
class LeaderRefreshed:
    """A new leader id after a failed delivery or mark: unacknowledged records will be re-marked."""

    leader_id: uuid.UUID


@dataclass(frozen=True)
class LeaderRevoked:
    """Kafka gave partition 0 to another replica (or this one is leaving); harvesting stopped."""


@dataclass(frozen=True)
class LeaderFenced:
    """No own heartbeat within the heartbeat timeout: this replica stopped sending, in case another leads."""


@dataclass(frozen=True)
class LeaderBlocked:
    """This replica leads its group, but another replica holds the table's database fence: it marks nothing."""

    holder: str


@dataclass(frozen=True)
class RecordHeld:
    """A record failed on its own and cannot be published as it is: its key waits (other keys go on)."""

    record_id: int
    key: str
    reason: str


@dataclass(frozen=True)
class RecordReleased:
    """A held record's key moves again: the record was fixed, retried, deleted or parked."""

    record_id: int
    key: str
    how: str


@dataclass(frozen=True)
class RecordParked:
    """A held record was moved to the dead-letter table (after `park_after` failures)."""

    record_id: int
    key: str
    reason: str


@dataclass(frozen=True)
class MeterStats:
    """Throughput over the last metering interval."""

    interval: float
    published: int
    rate: float
    total_published: int
    total_failed: int
    in_flight: int

    def __str__(self) -> str:
        """The throughput log line: "Published 131,600 records in 5.0 s (26,320 records/s); ..."."""
        return (f"Published {self.published:,} record{'s' * (self.published != 1)} in {self.interval:.1f} s "
                f"({rate_text(self.rate)} records/s); {self.total_published:,} published in all, "
                f"{self.total_failed:,} failed, {self.in_flight:,} in flight")


def rate_text(rate: float) -> str:
    """A rate as a person writes it: 26,320 / 26 / 2.6 / 0.2 / 0."""
    if rate >= 10:
        return f"{rate:,.0f}"
    if rate >= 1:
        return f"{rate:.1f}"
    return f"{rate:.1g}" if rate > 0 else "0"


@dataclass(frozen=True)
class MeterRead:
    """Periodic throughput reading, at most once every `min_metrics_interval`."""

    stats: MeterStats


Event = (LeaderAcquired | LeaderRefreshed | LeaderRevoked | LeaderFenced | LeaderBlocked | RecordHeld
         | RecordReleased | RecordParked | MeterRead)
