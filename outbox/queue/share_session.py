"""How soon a share group notices a dead consumer: its session timeout and heartbeat interval, derived
from the queue's lock and the brokers' ranges (no I/O; share_group.py asks the broker).

Only a member that has a partition fetches its records, and the share group's simple assignor gives
each partition to one member while the group has fewer members than the topic has partitions. So a
dead consumer's partitions, and the records it held (which the broker releases when its connection
closes, or at their lock's end), wait for the group to notice the death: `share.session.timeout.ms`
after its last heartbeat. A survivor learns of its new partitions on its next heartbeat and fetches
them on its next fetch. A SIGKILLed consumer's messages are therefore handled elsewhere within

    session timeout + heartbeat interval + one fetch wait (librdkafka's fetch.wait.max.ms, 500 ms)

The session follows the lock (the queue's redelivery_timeout: how long the queue lets a message wait
for a consumer that stopped) up to MAX_SESSION_MS, heartbeats are a quarter of it and at most 1 s, so
that is the lock plus at most 1.5 s, and at most 11.5 s for a long lock (the records a dead consumer
never took wait for the session too, not for the lock). The brokers bound both (group.share.min/max.session.timeout.ms,
group.share.min/max.heartbeat.interval.ms); where their minimum session is above the lock, the wait
is that minimum's instead, and the consumer says so in one line.

A short session is also a short tolerance: a consumer whose heartbeats stop for the session less one
heartbeat interval (the machine starved of CPU, the broker paused) is evicted although alive. Its
records go to another consumer and its late acknowledgements are refused; that is a redelivery
(at least once, counted towards max_deliveries), never a loss.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The heartbeat interval asked for, at most: a survivor hears of a dead member's partitions this soon.
MAX_HEARTBEAT_MS = 1_000
#: The session asked for, at most, however long the lock: a dead member's partitions (with records it never
#: took) move within this; what it held comes back at its lock's end or its connection's, whichever is first.
MAX_SESSION_MS = 10_000
#: librdkafka's fetch.wait.max.ms: a survivor's fetch in flight may wait this long before the next one
#: asks for its new partitions.
FETCH_WAIT_MS = 500


@dataclass(frozen=True, slots=True)
class BrokerRanges:
    """What the brokers let a share group ask for (the defaults are Apache Kafka 4.2's)."""

    min_session_ms: int = 45_000
    max_session_ms: int = 60_000
    min_heartbeat_ms: int = 5_000
    max_heartbeat_ms: int = 15_000


#: The broker configs that hold BrokerRanges, by field.
RANGE_CONFIGS = {
    "min_session_ms": "group.share.min.session.timeout.ms",
    "max_session_ms": "group.share.max.session.timeout.ms",
    "min_heartbeat_ms": "group.share.min.heartbeat.interval.ms",
    "max_heartbeat_ms": "group.share.max.heartbeat.interval.ms",
}
#: Ranges that were not read (no permission to describe the brokers): ask for the lock's own values.
UNBOUNDED = BrokerRanges(min_session_ms=1, max_session_ms=2**31 - 1, min_heartbeat_ms=1,
                         max_heartbeat_ms=2**31 - 1)


@dataclass(frozen=True, slots=True)
class FailureDetection:
    """A share group's session timeout and heartbeat interval, and the lock they were derived from."""

    session_ms: int
    heartbeat_ms: int
    lock_ms: int

    @property
    def settings(self) -> dict[str, str]:
        """The share group's configs (set through the admin client, as the lock is)."""
        return {"share.session.timeout.ms": str(self.session_ms),
                "share.heartbeat.interval.ms": str(self.heartbeat_ms)}

    @property
    def bound(self) -> float:
        """Seconds from a consumer's death to another member fetching its records, at most."""
        return (self.session_ms + self.heartbeat_ms + FETCH_WAIT_MS) / 1000

    @property
    def exceeds_target(self) -> bool:
        """The bound is more than the lock plus 2 s (issue 24's target): the brokers' minimums are too high."""
        return self.bound > self.lock_ms / 1000 + 2


def failure_detection(lock: float, ranges: BrokerRanges = UNBOUNDED) -> FailureDetection:
    """The session timeout follows the lock of `lock` seconds up to MAX_SESSION_MS, clamped to `ranges`;
    heartbeats a quarter of it, at most MAX_HEARTBEAT_MS, and always shorter than the session (the broker
    refuses anything else)."""
    lock_ms = max(1, round(lock * 1000))
    session = _clamp(min(lock_ms, MAX_SESSION_MS), ranges.min_session_ms, ranges.max_session_ms)
    heartbeat = _clamp(min(session // 4, MAX_HEARTBEAT_MS), ranges.min_heartbeat_ms, ranges.max_heartbeat_ms)
    if heartbeat >= session:  # brokers whose minimum heartbeat is above a short lock's session
        session = min(ranges.max_session_ms, max(session, 4 * heartbeat))
    return FailureDetection(session_ms=session, heartbeat_ms=heartbeat, lock_ms=lock_ms)


def _clamp(value: int, lowest: int, highest: int) -> int:
    return max(lowest, min(value, highest))
