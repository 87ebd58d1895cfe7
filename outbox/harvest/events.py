"""Events a Harvester reports to its `on_event` callback (the Django layer turns them into signals)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class LeaderAcquired:
    """This replica leads: it owns partition 0 of the leader topic and sees its own heartbeats."""

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
class MeterStats:
    """Throughput over the last metering interval."""

    interval: float
    published: int
    rate: float
    total_published: int
    total_failed: int
    in_flight: int


@dataclass(frozen=True)
class MeterRead:
    """Periodic throughput reading, at most once every `min_metrics_interval`."""

    stats: MeterStats


Event = LeaderAcquired | LeaderRefreshed | LeaderRevoked | LeaderFenced | MeterRead
