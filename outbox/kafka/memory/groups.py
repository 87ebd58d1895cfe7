"""Consumer groups over whole topics: assignment, cooperative rebalances, generations and offsets.

One model for every group the simulators and the fakes run: the queue's consumers and trackers, the sharded
replicas' leader topic, and the one-partition leader election of a single outbox. What they rely on is modelled:
- the coordinator spreads the subscribed topics' partitions evenly over the live members, sticky as
  cooperative-sticky is: a member keeps what it has up to its share, and the members that hold partitions are
  the ones whose share is rounded up (so a one-partition group keeps its owner while the owner lives). A
  partition that must move is revoked from its owner first and assigned to its new owner only once the owner's
  revoke callback returned (`revoked()`), the cooperative protocol's two rounds; a free partition is assigned
  at once;
- the coordinator's freedom, as faults: it may move a partition a member holds to another (`move()`; and, with
  `move_chance`, to a member that just joined), revoke one and assign it back to the same member (`bounce()`),
  and a member's session may expire at once (`expire()`);
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
from collections import Counter, deque
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
    def __init__(self, world: World, broker: Any, name: str, topics: list[str], session_timeout: float,
                 move_chance: float = 0.0) -> None:
        self.world = world
        self.broker = broker
        self.name = name
        self.topics = topics
        self.session_timeout = session_timeout
        #: How likely a member that joins is given a partition another member holds (moved as `move()` moves it).
        self.move_chance = move_chance
        self.members: list[GroupMember] = []
        self.owners: dict[TP, GroupMember] = {}
        self.revoking: dict[TP, GroupMember] = {}
        #: Partitions the coordinator moves away from their owners (`move()`), and to whom (None: any other).
        self.moving: dict[TP, GroupMember | None] = {}
        #: Partitions to revoke from their owner and assign straight back (`bounce()`), and those being revoked so.
        self._bouncing: set[TP] = set()
        self._returning: dict[TP, GroupMember] = {}
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
        taken = [tp for tp, owner in self.owners.items() if owner is not member and tp not in self.moving]
        if self.move_chance and taken and self.world.chance(self.move_chance):
            self.move(self.world.rng.choice(taken), to=member)
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
            if self._returning.pop(tp, None) is member and member.standing is Standing.MEMBER:
                self.owners[tp] = member  # bounce(): straight back
                self.moving.pop(tp, None)
                member.events.append(("assign", [tp]))
        self._rebalance_soon()

    def rejoined(self, member: GroupMember) -> bool:
        """At the member's poll: True once its rejoin completed (it then holds the current generation)."""
        if member.standing is not Standing.MEMBER or self.world.now < member.rejoin_at:
            return False
        member.generation = self.generation
        return True

    def owned_by(self, member: GroupMember) -> list[TP]:
        return [tp for tp, owner in self.owners.items() if owner is member]

    # -- faults -----------------------------------------------------------------------------------

    def move(self, tp: TP, to: GroupMember | None = None) -> None:
        """The coordinator moves `tp` from its owner (to `to`, or to another live member): the owner is revoked
        first, and `to` is assigned once the owner's callback returned."""
        if tp in self.owners or tp in self.revoking or to is not None:
            self.moving[tp] = to
            self._rebalance_soon()

    def bounce(self, tp: TP) -> None:
        """The coordinator revokes `tp` from its owner and assigns it back to that same owner as soon as its
        callback returned, served in the same poll (librdkafka serves a cooperative rebalance's revoke and the
        next assignment in one poll when they come together: the member's own view never lacks the partition)."""
        owner = self.owners.get(tp)
        if owner is not None and tp not in self.revoking and tp not in self.moving:
            self.moving[tp] = owner
            self._bouncing.add(tp)
            self._rebalance_soon()

    def expire(self, member: GroupMember) -> None:
        """The member's session expires (now, or at the coordinator's tick when it was not heard from for the
        session timeout): it is out at once, and learns so only when it can talk to the coordinator again."""
        if member.standing is Standing.MEMBER:
            member.lost = self.owned_by(member)
            member.standing = Standing.DROPPED
            member.events.clear()
            self._forget(member)

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
        for tp in [tp for tp, owner in self._returning.items() if owner is member]:
            del self._returning[tp]  # a bounce it never answered: nothing goes straight back to it
        for tp in [tp for tp in self._bouncing if self.moving.get(tp) is member]:
            self._bouncing.discard(tp)
            del self.moving[tp]
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
                self.expire(member)
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
        for tp, to in list(self.moving.items()):
            if tp not in partitions or (to is not None and to not in live):
                del self.moving[tp]  # the member it was moving to is gone: a rebalance as any other
                self._bouncing.discard(tp)
        base, extra = divmod(len(partitions), len(live))
        # The members a partition is moved to, then those holding the most, have their share rounded up.
        held = Counter(id(owner) for tp, owner in self.owners.items() if tp not in self.moving)
        chosen = {id(to) for to in self.moving.values() if to is not None}
        ranked = sorted(live, key=lambda m: (id(m) not in chosen, -held[id(m)]))
        share = {id(m): base + (1 if i < extra else 0) for i, m in enumerate(ranked)}
        target: dict[TP, GroupMember] = {}
        for tp, to in self.moving.items():
            if to is not None and share[id(to)] > 0:
                target[tp] = to
                share[id(to)] -= 1
        # Sticky: each keeps what it owns (or is handing over) up to its share, unless the coordinator moves it.
        for tp in partitions:
            owner = self.owners.get(tp)
            if tp not in target and tp not in self.moving and owner is not None and share[id(owner)] > 0:
                target[tp] = owner
                share[id(owner)] -= 1
        order = list(live)
        self.world.rng.shuffle(order)  # the coordinator's choice of who takes what is free
        for tp in partitions:
            if tp not in target:
                # A partition moved goes to another member than its owner when one has room.
                owner = self.owners.get(tp) if tp in self.moving else None
                takers = [m for m in order if share[id(m)] > 0]
                taker = next((m for m in takers if m is not owner), takers[0])
                target[tp] = taker
                share[id(taker)] -= 1
        assigned: dict[int, list[TP]] = {}
        revoked: dict[int, list[TP]] = {}
        for tp, member in target.items():
            owner = self.owners.get(tp)
            if tp in self._bouncing and member is not owner:
                self._bouncing.discard(tp)  # its owner has no room for it now: a move as any other
                self.moving.pop(tp, None)
            if owner is None:
                if tp not in self.revoking:
                    self.owners[tp] = member
                    self.moving.pop(tp, None)
                    assigned.setdefault(id(member), []).append(tp)
            elif owner is member and tp in self._bouncing and tp not in self.revoking:
                self._bouncing.discard(tp)  # revoked, and assigned back when its callback returns (revoked())
                self._returning[tp] = owner
                self.revoking[tp] = owner
                revoked.setdefault(id(owner), []).append(tp)
            elif owner is member:
                self.moving.pop(tp, None)  # nobody else can take it
            elif tp not in self.revoking:
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
