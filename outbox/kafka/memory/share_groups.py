"""Kafka's share groups (KIP-932) over the memory broker's topic logs: what a share queue relies on.

Modelled, per share group and topic:
- share-partitions: each record is available, acquired by one member (with a lock that ends at a
  deadline), acknowledged or archived. Every acquisition counts a delivery. ACCEPT acknowledges,
  RELEASE makes it available again, REJECT archives; a lock that ends, or a member that leaves or
  whose session expires, puts what it held back. A record put back that has had the broker's
  `group.share.delivery.count.limit` deliveries is archived instead;
- the start offset, read from the group's `share.auto.offset.reset` when the group is first fetched
  from: "earliest", or Kafka's default "latest" (the end of each partition then);
- the lock duration and the session timeout from the group's configuration
  (`share.record.lock.duration.ms`, `share.session.timeout.ms`; the broker's defaults otherwise);
- the simple assignor: while members are no more than partitions each partition has one member,
  else each member one partition (shared). A member learns a new assignment at its next poll after
  a heartbeat round trip, so two members may fetch one partition for a moment (harmless: records
  are locked one by one);
- acknowledgements apply only to the acquisition they name: after its lock ended, or its member was
  dropped, an acknowledgement is refused (the client's callback hears INVALID_RECORD_STATE).

Watchers (the simulator's checks) hear of every acquisition, acknowledgement and release.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from outbox.kafka.memory.world import World

#: The broker's defaults (a group's configuration overrides the first two).
DEFAULT_LOCK_MS = 30_000
DEFAULT_SESSION_MS = 45_000
DEFAULT_DELIVERY_LIMIT = 5
#: How often the coordinator checks its members' sessions.
TICK = 0.25


class RecordState(enum.Enum):
    AVAILABLE = "available"
    ACQUIRED = "acquired"
    ACKNOWLEDGED = "acknowledged"
    ARCHIVED = "archived"


class Standing(enum.Enum):
    MEMBER = "member"
    DROPPED = "dropped"  # its session expired; it rejoins as a new member at its next poll
    LEFT = "left"


@dataclass(eq=False)
class ShareMember:
    name: str
    alive: Callable[[], bool]
    standing: Standing = Standing.LEFT
    #: The partitions it fetches from: the coordinator's, once its heartbeat brought them.
    assigned: list[int] = field(default_factory=list)
    pending: list[int] | None = None
    learns_at: float = 0.0
    last_heard: float = 0.0


@dataclass(eq=False)
class InFlight:
    """A record of a share-partition that has been acquired at least once."""

    partition: int
    offset: int
    state: RecordState = RecordState.AVAILABLE
    deliveries: int = 0
    member: ShareMember | None = None
    #: Numbers each acquisition (an acknowledgement names the one it settles).
    acquisition: int = 0
    lock_ends: float = 0.0


@dataclass(frozen=True)
class Acquired:
    """What a fetch hands the client: the record and the acquisition its acknowledgement names."""

    record: Any
    partition: int
    offset: int
    deliveries: int
    acquisition: int


class ShareGroup:
    """One share group over one topic."""

    def __init__(self, world: World, broker: Any, name: str, topic: str) -> None:
        self.world, self.broker, self.name, self.topic = world, broker, name, topic
        #: The group's configuration (incremental_alter_configs on the GROUP resource).
        self.config: dict[str, str] = {}
        #: The broker's group.share.delivery.count.limit.
        self.delivery_limit = DEFAULT_DELIVERY_LIMIT
        self.members: list[ShareMember] = []
        #: partition -> the first offset not yet acknowledged or archived (the share-partition start offset).
        self.start: dict[int, int] | None = None
        self.records: dict[tuple[int, int], InFlight] = {}
        self.watchers: list[Any] = []
        self._acquisitions = 0
        self._ticking = False

    # -- configuration ----------------------------------------------------------------------------

    @property
    def lock_duration(self) -> float:
        return int(self.config.get("share.record.lock.duration.ms", DEFAULT_LOCK_MS)) / 1000

    @property
    def session_timeout(self) -> float:
        return int(self.config.get("share.session.timeout.ms", DEFAULT_SESSION_MS)) / 1000

    # -- membership -------------------------------------------------------------------------------

    def join(self, member: ShareMember) -> None:
        member.standing, member.last_heard = Standing.MEMBER, self.world.now
        if member not in self.members:
            self.members.append(member)
        if not self._ticking:
            self._ticking = True
            self.world.after(TICK, self._tick)
        self._assign()

    def leave(self, member: ShareMember) -> None:
        """A graceful leave (the client's close): what it holds goes back at once."""
        if member.standing is Standing.MEMBER:
            member.standing = Standing.LEFT
            self._gone(member, "left the group")

    def heard(self, member: ShareMember) -> None:
        """A call from the member reached the coordinator: its assignment, if a new one is due."""
        member.last_heard = self.world.now
        if member.pending is not None and self.world.now >= member.learns_at:
            member.assigned, member.pending = member.pending, None

    def _gone(self, member: ShareMember, why: str) -> None:
        self.members = [m for m in self.members if m is not member]
        member.assigned, member.pending = [], None
        for entry in list(self.records.values()):
            if entry.state is RecordState.ACQUIRED and entry.member is member:
                self._put_back(entry, f"{member.name} {why}")
        self._assign()

    def _tick(self) -> None:
        now = self.world.now
        for member in list(self.members):
            if member.alive():
                member.last_heard = now
            elif now - member.last_heard > self.session_timeout:
                member.standing = Standing.DROPPED
                self._gone(member, "was dropped (session timeout)")
        self.world.after(TICK, self._tick)

    def _assign(self) -> None:
        """The simple assignor, learnt by each member at a heartbeat (every 2 s at most, here sooner or later)."""
        live = [m for m in self.members if m.standing is Standing.MEMBER]
        partitions = len(self.broker.log(self.topic))
        target: dict[int, list[int]] = {id(m): [] for m in live}
        if live and len(live) <= partitions:
            for p in range(partitions):
                target[id(live[p % len(live)])].append(p)
        else:
            for i, member in enumerate(live):
                target[id(member)].append(i % partitions)
        for member in live:
            if target[id(member)] != (member.pending if member.pending is not None else member.assigned):
                member.pending = target[id(member)]
                member.learns_at = self.world.now + self.world.latency(0.01, 2.0)

    # -- records ----------------------------------------------------------------------------------

    def fetch(self, member: ShareMember, limit: int, ago: float = 0.0) -> list[Acquired]:
        """Acquire up to `limit` available records of the member's partitions, lowest offsets first, `ago`
        seconds ago (the fetch's answer took that long to reach the client: their locks started then)."""
        if member.standing is not Standing.MEMBER:
            return []
        logs = self.broker.log(self.topic)
        if self.start is None:  # the share-partitions are initialised at the group's first fetch
            latest = self.config.get("share.auto.offset.reset", "latest") == "latest"
            self.start = {p: len(log) if latest else 0 for p, log in enumerate(logs)}
        found: list[Acquired] = []
        partitions = list(member.assigned)
        self.world.rng.shuffle(partitions)
        for partition in partitions:
            log = logs[partition]
            offset = self._advance(partition)
            while offset < len(log) and len(found) < limit:
                entry = self.records.get((partition, offset))
                if entry is None:
                    entry = self.records[(partition, offset)] = InFlight(partition, offset)
                if entry.state is RecordState.AVAILABLE:
                    found.append(self._acquire(entry, member, log[offset], ago))
                offset += 1
        return found

    def _acquire(self, entry: InFlight, member: ShareMember, record: Any, ago: float) -> Acquired:
        self._acquisitions += 1
        entry.state, entry.member, entry.acquisition = RecordState.ACQUIRED, member, self._acquisitions
        entry.deliveries += 1
        entry.lock_ends = self.world.now - ago + self.lock_duration
        acquisition = entry.acquisition
        self.world.at(entry.lock_ends, lambda: self._lock_ended(entry, acquisition))
        for watcher in self.watchers:
            watcher.acquired(member.name, record, entry.deliveries, entry.lock_ends)
        return Acquired(record, entry.partition, entry.offset, entry.deliveries, acquisition)

    def _lock_ended(self, entry: InFlight, acquisition: int) -> None:
        if entry.state is RecordState.ACQUIRED and entry.acquisition == acquisition:
            self._put_back(entry, "its lock ended")

    def _put_back(self, entry: InFlight, why: str) -> None:
        archive = entry.deliveries >= self.delivery_limit
        entry.state = RecordState.ARCHIVED if archive else RecordState.AVAILABLE
        entry.member = None
        for watcher in self.watchers:
            watcher.put_back(self._record(entry), entry.deliveries, why, archived=archive)

    def acknowledge(self, member: ShareMember, partition: int, offset: int, acquisition: int, ack: str, *,
                    lost: bool = False) -> bool:
        """An acknowledgement (ACCEPT, RELEASE, REJECT) reached the broker (`lost`: its request failed on the way);
        False if refused or lost."""
        entry = self.records.get((partition, offset))
        applied = not lost and (entry is not None and entry.state is RecordState.ACQUIRED and entry.member is member
                   and entry.acquisition == acquisition and member.standing is Standing.MEMBER)
        record = self.broker.log(self.topic)[partition][offset]
        if applied:
            assert entry is not None
            entry.member = None
            if ack == "accept":
                entry.state = RecordState.ACKNOWLEDGED
            elif ack == "reject" or entry.deliveries >= self.delivery_limit:
                entry.state = RecordState.ARCHIVED
            else:
                entry.state = RecordState.AVAILABLE
        for watcher in self.watchers:
            watcher.acknowledged(member.name, record, entry.deliveries if entry else 0, ack, applied=applied,
                                 archived=applied and entry is not None and entry.state is RecordState.ARCHIVED,
                                 lost=lost)
        return applied

    def _advance(self, partition: int) -> int:
        """The start offset moves past acknowledged and archived records."""
        assert self.start is not None
        offset = self.start[partition]
        while True:
            entry = self.records.get((partition, offset))
            if entry is None or entry.state not in (RecordState.ACKNOWLEDGED, RecordState.ARCHIVED):
                break
            del self.records[(partition, offset)]
            offset += 1
        self.start[partition] = offset
        return offset

    def _record(self, entry: InFlight) -> Any:
        return self.broker.log(self.topic)[entry.partition][entry.offset]


def share_group(broker: Any, name: str, topic: str) -> ShareGroup:
    """The broker's share group `name` (made on first use), kept beside its consumer groups."""
    groups: dict[str, ShareGroup] = broker.share_groups
    if name not in groups:
        groups[name] = ShareGroup(broker.world, broker, name, topic)
    return groups[name]
