"""The simulated outbox table: rows that become visible when their transaction commits, database
sessions that can drop, the table's advisory-lock fence, and statements that fail before or after
they commit.

It runs the engine's statements with the same meaning as contract.py's SQL, and checks two of
the invariants as it goes: no row is deleted unless its record is in Kafka, and no purge or reset
touches a row marked under another leader id.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from outbox.harvest.contract import Record
from tests.sim.world import Violation, World

EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
POISON = "POISON"


@dataclass(slots=True)
class Row:
    id: int
    key: str
    value: str | None
    topic: str = "orders"
    leader_id: uuid.UUID | None = None
    version: int = 0
    committed: bool = False
    created: float = 0.0
    xid: int | None = None  # given when the row is written, a moment after its id was taken

    def record(self) -> Record:
        return Record(self.id, EPOCH, self.topic, self.key, self.value, [], [], self.leader_id, self.version)


@dataclass(eq=False)
class Session:
    """One database connection of one replica incarnation."""

    owner: str  # replica incarnation name
    group: str
    alive: bool = True
    holds_fence: bool = False  # the database's truth
    believes_fence: bool = False  # what the client thinks (store.PostgresStore._fence_held)


class StatementFailed(Exception):
    pass


@dataclass
class TableFaults:
    fail_before: float = 0.0  # a statement fails and changes nothing
    fail_after: float = 0.0  # a statement commits but its reply is lost
    slow: float = 0.0  # a statement takes far longer than usual (a checkpoint, a lock)
    latency: tuple[float, float] = (0.0005, 0.004)
    slow_latency: tuple[float, float] = (0.05, 0.5)


@dataclass
class SimTable:
    world: World
    published: Callable[[int], bool]  # is this record id in Kafka?
    faults: TableFaults = field(default_factory=TableFaults)
    guard_purges: bool = True  # False only in the mutation "purging without the leader-id guard"
    #: False: advisory locks do not fence (PgBouncer in transaction mode): every replica "takes" it.
    db_fence: bool = True
    rows: dict[int, Row] = field(default_factory=dict)
    fence_holder: Session | None = None
    removed_by_operator: set[int] = field(default_factory=set)
    parked: set[int] = field(default_factory=set)
    poison: set[int] = field(default_factory=set)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _versions: itertools.count = field(default_factory=lambda: itertools.count(1))
    committed: list[int] = field(default_factory=list)
    next_xid: int = 3
    running: dict[int, str] = field(default_factory=dict)  # xid -> what

    # -- writers --------------------------------------------------------------------------------

    def insert(self, key: str, value: str) -> Row:
        """A writer's INSERT: the id is taken now (nextval); the row is written (and its transaction
        gets an xid) a moment later; it is visible once commit() runs."""
        row = Row(next(self._ids), key, value, version=next(self._versions), created=self.world.now)
        self.rows[row.id] = row
        if value == POISON:
            self.poison.add(row.id)

        def write() -> None:
            if row.xid is None and not row.committed:
                row.xid = self.begin(f"insert {row.id}")
        self.world.after(self.world.latency(0.0, 0.001), write)
        return row

    def commit(self, row: Row) -> None:
        if row.xid is None:
            row.xid = self.begin(f"insert {row.id}")
        self.end(row.xid)
        row.committed = True
        self.committed.append(row.id)

    def begin(self, what: str) -> int:
        xid = self.next_xid
        self.next_xid += 1
        self.running[xid] = what
        return xid

    def end(self, xid: int) -> None:
        self.running.pop(xid, None)

    def snapshot(self) -> tuple[int, int]:
        """pg_current_snapshot(): (xmin, xmax): the oldest running xid, and the next one."""
        return (min(self.running) if self.running else self.next_xid), self.next_xid

    # -- operators ------------------------------------------------------------------------------

    def operator_fix(self, row_id: int, value: str) -> None:
        row = self.rows.get(row_id)
        if row is not None:
            row.value = value
            row.version = next(self._versions)
            self.poison.discard(row_id)

    def operator_delete(self, row_id: int) -> None:
        if self.rows.pop(row_id, None) is not None:
            self.removed_by_operator.add(row_id)
            self.poison.discard(row_id)

    # -- sessions and the fence -----------------------------------------------------------------

    def drop(self, session: Session) -> None:
        session.alive = False
        session.believes_fence = False
        if self.fence_holder is session:
            self.fence_holder = None
            session.holds_fence = False

    def _run(self, session: Session, apply: Callable[[], object]) -> object:
        """Run one statement with the configured faults; raises StatementFailed like a broken connection."""
        if not session.alive:
            raise StatementFailed("the session was ended")
        if self.world.chance(self.faults.fail_before):
            self.drop(session)
            raise StatementFailed("injected: connection lost before the statement ran")
        result = apply()
        if self.world.chance(self.faults.fail_after):
            self.drop(session)
            raise StatementFailed("injected: connection lost after the statement committed")
        return result

    def take_fence(self, session: Session) -> str | None:
        def apply() -> str | None:
            if not self.db_fence:
                return None
            holder = self.fence_holder
            if holder is session:
                return None
            if holder is not None and holder.alive and holder.group == session.group:
                self.world.note(f"fence: {session.owner} ends the session of stale {holder.owner}")
                self.drop(holder)
                holder = None
            if holder is None:
                self.fence_holder = session
                session.holds_fence = True
                return None
            return f"{holder.owner} of group {holder.group}"
        result = self._run(session, apply)
        if result is None:
            session.believes_fence = True
        return result  # type: ignore[return-value]

    def release_fence(self, session: Session) -> None:
        if self.fence_holder is session:
            self.fence_holder = None
        session.holds_fence = session.believes_fence = False

    # -- the engine's statements ----------------------------------------------------------------

    def mark(self, session: Session, leader_id: uuid.UUID, limit: int, after: int,
             upto: int | None) -> tuple[list[Record], tuple[int, int]]:
        if not session.believes_fence:
            raise StatementFailed("the database fence was lost with its session")

        def apply() -> tuple[list[Record], tuple[int, int]]:
            if self.db_fence and self.fence_holder is not session:
                raise Violation(f"{session.owner} marked without holding the table's fence")
            snapshot = self.snapshot()  # read just before the mark, in the same round trip
            top = upto if upto is not None else float("inf")
            chosen = sorted((r for r in self.rows.values()
                             if r.committed and r.leader_id != leader_id and after < r.id <= top),
                            key=lambda r: r.id)[:limit]
            for row in chosen:
                row.leader_id = leader_id
                row.version = next(self._versions)
            return [row.record() for row in chosen], snapshot
        return self._run(session, apply)  # type: ignore[return-value]

    def purge(self, session: Session, items: Sequence[tuple[int, uuid.UUID]],
              fence: Session | None = None) -> tuple[int, bool]:
        def apply() -> tuple[int, bool]:
            removed = 0
            for row_id, leader_id in items:
                row = self.rows.get(row_id)
                if row is None:
                    continue
                if row.leader_id != leader_id:
                    if self.guard_purges:
                        continue
                    raise Violation(f"purge by leader {_short(leader_id)} deleted row {row_id}, which leader "
                                    f"{_short(row.leader_id)} had marked")
                if not self.published(row_id):
                    raise Violation(f"row {row_id} was purged before Kafka had it")
                del self.rows[row_id]
                removed += 1
            return removed, fence is None or not self.db_fence or self.fence_holder is fence
        return self._run(session, apply)  # type: ignore[return-value]

    def reset(self, session: Session, items: Sequence[tuple[int, uuid.UUID]],
              fence: Session | None = None) -> tuple[int, bool]:
        def apply() -> tuple[int, bool]:
            count = 0
            for row_id, leader_id in items:
                row = self.rows.get(row_id)
                if row is None or row.leader_id != leader_id:
                    continue
                row.leader_id = None
                row.version = next(self._versions)
                count += 1
            return count, fence is None or not self.db_fence or self.fence_holder is fence
        return self._run(session, apply)  # type: ignore[return-value]

    def hold(self, session: Session, row_id: int, leader_id: uuid.UUID) -> int | None:
        def apply() -> int | None:
            row = self.rows.get(row_id)
            if row is None or row.leader_id != leader_id:
                return None
            row.version = next(self._versions)
            return row.version
        return self._run(session, apply)  # type: ignore[return-value]

    def check_held(self, session: Session, ids: Sequence[int]) -> dict[int, Record]:
        def apply() -> dict[int, Record]:
            return {i: self.rows[i].record() for i in ids if i in self.rows}
        return self._run(session, apply)  # type: ignore[return-value]

    def park(self, session: Session, record: Record) -> bool:
        def apply() -> bool:
            row = self.rows.get(record.id)
            if row is None or row.leader_id != record.leader_id:
                return False
            del self.rows[record.id]
            self.parked.add(record.id)
            self.poison.discard(record.id)
            return True
        return self._run(session, apply)  # type: ignore[return-value]

    # -- end of run -----------------------------------------------------------------------------

    def pending(self) -> list[Row]:
        """Rows that should have been published by the end of a run: not poison no one fixed, nor
        behind such a record in its key (they wait for it, by design)."""
        blocking: dict[str, int] = {}
        for row_id in self.poison:
            row = self.rows.get(row_id)
            if row is not None and row.committed:
                blocking[row.key] = min(blocking.get(row.key, row_id), row_id)
        return [row for row in self.rows.values()
                if row.committed and row.id not in self.poison and not row.id > blocking.get(row.key, row.id)]


def _short(leader_id: uuid.UUID | None) -> str:
    return "none" if leader_id is None else str(leader_id)[:8]
