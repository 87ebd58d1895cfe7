"""Consumer groups over whole topics: assignment, cooperative rebalances, generations and offsets.

What the queue's consumers and trackers rely on is modelled (the leader election's one-partition
group is broker.Group):
- the coordinator spreads the subscribed topic's partitions evenly over the live members, sticky:
  a member keeps what it has up to its share. A partition that must move is revoked from its
  owner first and assigned to its new owner only once the owner's revoke callback returned
  (`revoked()`), the cooperative protocol's two rounds; a free partition is assigned at once;
- every change of membership is a new generation. A member learns it, with its assignment,
  when its rejoin round trip completes (a little after the change; at its next poll after that);
  meanwhile, and always after it was dropped or left, the offsets it commits are refused
  (ILLEGAL_GENERATION, UNKNOWN_MEMBER_ID): KIP-447's fence for transactions too;
- a member not heard from for the session timeout (its process crashed or is paused) is dropped
  and its partitions move at once; it learns so only when it can talk again, and then a round
  trip later (`notice`), so a paused process resumes as a zombie for a moment;
- committed offsets are per partition; a commit may move them anywhere, backwards included,
  as Kafka's do.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError

from outbox.kafka.memory.world import World

TP = tuple[str, int]
#: How often the coordinator checks its members' sessions.
TICK = 0.25


class Standing(enum.Enum):
    MEMBER = "member"
    DROPPED = "dropped"  # its session expired; it has not noticed yet
    LEFT = "left"


@dataclass(eq=False)
class GroupMember:
    """One consumer in a group, as the coordinator sees it."""

    name: str
    #: Heard by the coordinator (its process runs and reaches Kafka).
    alive: Callable[[], bool]
    #: ("assign" | "revoke", partitions), served at its polls once its rejoin round trip completed.
    events: deque[tuple[str, list[TP]]] = field(default_factory=deque)
    standing: Standing = Standing.LEFT
    generation: int = -1
    rejoin_at: float = 0.0
    last_heard: float = 0.0
    #: Dropped: what it held, for its on_lost callback.
    lost: list[TP] = field(default_factory=list)


@dataclass(frozen=True)
class GroupMetadata:
    """consumer_group_metadata(): what send_offsets_to_transaction() carries for the fence."""

    group: str
    member: GroupMember
    generation: int


class ConsumerGroup:
    def __init__(self, world: World, broker: Any, name: str, topics: list[str], session_timeout: float) -> None:
        self.world = world
        self.broker = broker
        self.name = name
        self.topics = topics
        self.session_timeout = session_timeout
        self.members: list[GroupMember] = []
        self.owners: dict[TP, GroupMember] = {}
        self.revoking: dict[TP, GroupMember] = {}
        self.committed: dict[TP, int] = {}
        self.generation = 0
        self._changed = False  # membership changed since the last rebalance: a new generation
        self._rebalancing = False
        self._ticking = False

    # -- membership -------------------------------------------------------------------------------

    def join(self, member: GroupMember) -> None:
        member.standing = Standing.MEMBER
        member.last_heard = self.world.now
        member.events.clear()
        member.lost = []
        if member not in self.members:
            self.members.append(member)
        if not self._ticking:
            self._ticking = True
            self.world.after(TICK, self._tick)
        self._changed = True
        self._rebalance_soon()

    def leave(self, member: GroupMember) -> None:
        """A graceful leave (its revoke callback has run): its partitions move at once."""
        if member.standing is Standing.MEMBER:
            member.standing = Standing.LEFT
            self._forget(member)

    def revoked(self, member: GroupMember, partitions: list[TP]) -> None:
        """The member's revoke callback returned: the partitions may go to their new owners."""
        for tp in partitions:
            if self.revoking.get(tp) is member:
                del self.revoking[tp]
            if self.owners.get(tp) is member:
                del self.owners[tp]
        self._rebalance_soon()

    def rejoined(self, member: GroupMember) -> bool:
        """At the member's poll: True once its rejoin completed (it then holds the current generation)."""
        if member.standing is not Standing.MEMBER or self.world.now < member.rejoin_at:
            return False
        member.generation = self.generation
        return True

    def owned_by(self, member: GroupMember) -> list[TP]:
        return [tp for tp, owner in self.owners.items() if owner is member]

    # -- offsets ----------------------------------------------------------------------------------

    def refusal(self, member: GroupMember, generation: int) -> KafkaError | None:
        """Why an offset commit by `member` at `generation` is refused, or None."""
        if member.standing is not Standing.MEMBER:
            return KafkaError(KafkaError.UNKNOWN_MEMBER_ID, "Broker: Unknown member")
        if generation != self.generation:
            return KafkaError(KafkaError.ILLEGAL_GENERATION, "Broker: Specified group generation id is not valid")
        return None

    def commit(self, offsets: dict[TP, int], *, notify: bool = True) -> None:
        self.committed.update(offsets)
        if notify:  # (a transaction's watchers hear of its offsets with its records)
            for watcher in self.broker.watchers:
                watcher.committed(self.name, offsets)

    # -- the coordinator --------------------------------------------------------------------------

    def _forget(self, member: GroupMember) -> None:
        for tp in [tp for tp, owner in self.owners.items() if owner is member]:
            del self.owners[tp]
        for tp in [tp for tp, owner in self.revoking.items() if owner is member]:
            del self.revoking[tp]
        self._changed = True
        self._rebalance_soon()

    def _tick(self) -> None:
        now = self.world.now
        for member in self.members:
            if member.standing is not Standing.MEMBER:
                continue
            if member.alive():
                member.last_heard = now
            elif now - member.last_heard > self.session_timeout:
                # The session expired: out; it learns so when it can talk to the coordinator again.
                member.lost = self.owned_by(member)
                member.standing = Standing.DROPPED
                member.events.clear()
                self._forget(member)
        self.members = [m for m in self.members if m.standing is not Standing.LEFT]
        self.world.after(TICK, self._tick)

    def _rebalance_soon(self) -> None:
        if not self._rebalancing:
            self._rebalancing = True
            self.world.after(self.world.latency(0.01, 0.2), self._rebalance)

    def _partitions(self) -> list[TP]:
        return [(topic, p) for topic in self.topics for p in range(len(self.broker.log(topic)))]

    def _rebalance(self) -> None:
        self._rebalancing = False
        live = [m for m in self.members if m.standing is Standing.MEMBER]
        if not live:
            self._changed = False
            self.generation += 1
            return
        partitions = self._partitions()
        base, extra = divmod(len(partitions), len(live))
        share = {id(m): base + (1 if i < extra else 0) for i, m in enumerate(live)}
        # Sticky: each keeps what it owns (or is handing over) up to its share.
        target: dict[TP, GroupMember] = {}
        for tp in partitions:
            owner = self.owners.get(tp)
            if owner is not None and share[id(owner)] > 0:
                target[tp] = owner
                share[id(owner)] -= 1
        order = list(live)
        self.world.rng.shuffle(order)  # the coordinator's choice of who takes what is free
        for tp in partitions:
            if tp not in target:
                taker = next(m for m in order if share[id(m)] > 0)
                target[tp] = taker
                share[id(taker)] -= 1
        assigned: dict[int, list[TP]] = {}
        revoked: dict[int, list[TP]] = {}
        for tp, member in target.items():
            owner = self.owners.get(tp)
            if owner is None:
                if tp not in self.revoking:
                    self.owners[tp] = member
                    assigned.setdefault(id(member), []).append(tp)
            elif owner is not member and tp not in self.revoking:
                self.revoking[tp] = owner
                revoked.setdefault(id(owner), []).append(tp)
        if not assigned and not revoked and not self._changed:
            return
        self._changed = False
        self.generation += 1
        for member in live:
            member.rejoin_at = self.world.now + self.world.latency(0.005, 0.1)
            if id(member) in revoked:
                member.events.append(("revoke", revoked[id(member)]))
            if id(member) in assigned:
                member.events.append(("assign", assigned[id(member)]))
