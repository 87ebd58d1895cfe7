"""The outbox table in memory: rows that become visible when their transaction commits, database
sessions that can drop, a server that can crash and restart (undoing the purges that committed
asynchronously and were not flushed yet), the table's advisory-lock fence (with shards, each shard's fence and the
shared locks store.py takes beside it, sharding.py), and statements that fail before or after
they commit. `MemoryStore` is the engine's Store (connector.py) over it, with the real store's two
sessions; a statement that fails raises psycopg.OperationalError, as the real store's do.

It runs the engine's statements with the same meaning as contract.py's SQL (a shard's store marks
only its shard's rows, contract.reads()), and checks invariants as it goes: no row is deleted unless
its record is in Kafka, and nobody marks the table (or a shard) without holding its fence.
"""

from __future__ import annotations

import functools
import itertools
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import psycopg

from outbox.harvest.contract import Record
from outbox.harvest.sharding import shard_of
from outbox.harvest.store import FenceHolder
from outbox.kafka.memory.broker import POISONS
from outbox.kafka.memory.world import Violation, World

EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
#: Postgres' WAL writer flushes an asynchronous commit within three wal_writer_delay (200 ms by default).
ASYNC_FLUSH_BOUND = 0.6


@functools.lru_cache(maxsize=4096)
def key_shard(key: str, shards: int) -> int:
    """shard_of, remembered (a simulated mark looks at every row's key)."""
    return shard_of(key, shards)


@dataclass(slots=True)
class Row:
    id: int
    key: str
    value: str | None
    topic: str = "orders"
    header_keys: tuple[str, ...] = ()
    header_values: tuple[str, ...] = ()
    leader_id: uuid.UUID | None = None
    version: int = 0
    committed: bool = False
    created: float = 0.0
    create_time: datetime = EPOCH
    reset_count: int = 0
    last_error: str | None = None
    #: The writing transaction (its virtual id), from before the id was taken until it ends.
    writer: str = ""

    def record(self) -> Record:
        return Record(self.id, self.create_time, self.topic, self.key, self.value, list(self.header_keys),
                      list(self.header_values), self.leader_id, self.version)


@dataclass(eq=False)
class Session:
    """One database connection of one replica incarnation."""

    owner: str  # replica incarnation name
    group: str
    alive: bool = True
    holds_fence: bool = False  # the database's truth
    believes_fence: bool = False  # what the client thinks (store.PostgresStore._fence_held)
    #: The store's shards and shard (sharding.py): 1 is the unsharded table's store.
    shards: int = 1
    shard: int = 0
    #: After taking a shard's fence: its previous leader, if that one did not settle.
    unsettled: str | None = None


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
class MemoryTable:
    world: World
    published: Callable[[int], bool] = lambda _record_id: True  # is this record id in Kafka?
    faults: TableFaults = field(default_factory=TableFaults)
    #: False: advisory locks do not fence (PgBouncer in transaction mode): every replica "takes" it.
    db_fence: bool = True
    rows: dict[int, Row] = field(default_factory=dict)
    fence_holder: Session | None = None
    #: Shards (store.py): each shard's fence, held exclusively, by (N, shard); beside it a shard's leader
    #: holds the table's fence key shared and its N's key shared (in the order they were taken).
    shard_fences: dict[tuple[int, int], Session] = field(default_factory=dict)
    table_shared: dict[Session, None] = field(default_factory=dict)
    count_shared: dict[int, dict[Session, None]] = field(default_factory=dict)
    #: The shard terms table (contract.CLAIM_SHARD), by (N, shard): the last leader's store and whether it
    #: let go settled.
    shard_terms: dict[tuple[int, int], tuple[str, bool]] = field(default_factory=dict)
    #: Who marked each shard last (its session's owner), by (N, shard): the simulator's hand-off check.
    marked_by: dict[tuple[int, int], str] = field(default_factory=dict)
    removed_by_operator: set[int] = field(default_factory=set)
    parked: set[int] = field(default_factory=set)
    dead_letters: list[tuple[Row, str]] = field(default_factory=list)
    poison: set[int] = field(default_factory=set)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _versions: itertools.count = field(default_factory=lambda: itertools.count(1))
    _transactions: itertools.count = field(default_factory=lambda: itertools.count(1))
    committed: list[int] = field(default_factory=list)
    rolled_back: list[int] = field(default_factory=list)
    #: Transactions holding a row-exclusive lock on the table (writing to it), by virtual id.
    writers: set[str] = field(default_factory=set)
    #: Other transactions running (they hold the database's horizon back; they write nothing here).
    running: dict[str, str] = field(default_factory=dict)
    #: Rows deleted by purges that committed asynchronously since the last commit that waited for the
    #: flush (which flushes them too: the WAL is one sequence), with when: a crash brings them back.
    unflushed: list[tuple[float, Row]] = field(default_factory=list)
    #: The server is restarting until then: every statement fails.
    down_until: float = 0.0

    # -- writers --------------------------------------------------------------------------------

    def insert(self, key: str, value: str | None, *, topic: str = "orders", headers: Sequence[tuple[str, str]] = (),
               create_time: datetime = EPOCH) -> Row:
        """A writer's INSERT: its transaction locks the table (a writer from now on), then takes the
        id (nextval); the row is visible once commit() runs, and never if rollback() does."""
        writer = f"w{next(self._transactions)}"
        self.writers.add(writer)
        row = Row(next(self._ids), key, value, topic, tuple(k for k, _ in headers), tuple(v for _, v in headers),
                  version=next(self._versions), created=self.world.now, create_time=create_time, writer=writer)
        self.rows[row.id] = row
        if value in POISONS:
            self.poison.add(row.id)
        return row

    def commit(self, row: Row) -> None:
        self.writers.discard(row.writer)
        row.committed = True
        self.committed.append(row.id)
        self.unflushed.clear()  # a writer's commit waits for the flush of the WAL up to it

    def rollback(self, row: Row) -> None:
        self.writers.discard(row.writer)
        if self.rows.get(row.id) is row and not row.committed:
            del self.rows[row.id]
            self.poison.discard(row.id)
            self.rolled_back.append(row.id)

    def begin(self, what: str) -> str:
        """A transaction that writes nothing to the outbox (a report, an idle session)."""
        name = f"t{next(self._transactions)}"
        self.running[name] = what
        return name

    def end(self, name: str) -> None:
        self.running.pop(name, None)

    # -- operators ------------------------------------------------------------------------------

    def operator_update(self, row_id: int, **changes: object) -> None:
        """An operator's UPDATE (a fix): the row's version changes."""
        row = self.rows.get(row_id)
        if row is not None:
            for name, value in changes.items():
                setattr(row, name, value)
            row.version = next(self._versions)
            if row.value not in POISONS:
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
        if session.shards > 1:
            self._let_go(session)  # pg_terminate_backend, or the connection closed: its locks go with it

    def _let_go(self, session: Session) -> None:
        key = (session.shards, session.shard)
        if self.shard_fences.get(key) is session:
            del self.shard_fences[key]
        self.table_shared.pop(session, None)
        self.count_shared.get(session.shards, {}).pop(session, None)
        session.holds_fence = False

    def restart(self, sessions: Sequence[Session], lost_within: float, down_for: float) -> list[int]:
        """The server crashes and starts again: every session ends (the fences with them), statements
        fail for `down_for`, and the purges that committed asynchronously in the last `lost_within`
        seconds (at most ASYNC_FLUSH_BOUND) and were not flushed by a commit since are undone: their
        rows are back. Returns their ids."""
        for session in sessions:
            self.drop(session)
        self.down_until = self.world.now + down_for
        since = self.world.now - min(lost_within, ASYNC_FLUSH_BOUND)
        undone = [row for deleted_at, row in self.unflushed if deleted_at >= since]
        self.unflushed.clear()
        for row in undone:
            self.rows[row.id] = row
        return [row.id for row in undone]

    def _run(self, session: Session, apply: Callable[[], object]) -> object:
        """Run one statement with the configured faults; raises StatementFailed like a broken connection."""
        if not session.alive:
            raise StatementFailed("the session was ended")
        if self.world.now < self.down_until:
            self.drop(session)
            raise StatementFailed("the database system is starting up")
        if self.world.chance(self.faults.fail_before):
            self.drop(session)
            raise StatementFailed("injected: connection lost before the statement ran")
        result = apply()
        if self.world.chance(self.faults.fail_after):
            self.drop(session)
            raise StatementFailed("injected: connection lost after the statement committed")
        return result

    def take_fence(self, session: Session, end_stale: bool = True) -> str | FenceHolder | None:
        if session.shards > 1:
            return self._take_shard_fence(session, end_stale)

        def apply() -> str | FenceHolder | None:
            if not self.db_fence:
                return None
            holder = self.fence_holder
            if holder is session:
                return None
            tries = 3
            while holder is None and self.table_shared:
                # Shards' leaders hold the table's key shared (store.py): the exclusive lock waits for all
                # of them, and one of our own group is ended as stale, as the store does (three tries).
                shared = next(iter(self.table_shared))
                same = shared.group == session.group
                if not same or not end_stale or tries == 0:
                    return FenceHolder(0, shared.owner, shared.group, "sim", same_group=same)
                self.world.note(f"fence: {session.owner} ends the session of shard leader {shared.owner}")
                self.drop(shared)
                tries -= 1
            if holder is not None and holder.alive and holder.group == session.group and not end_stale:
                return FenceHolder(0, holder.owner, holder.group, "sim", same_group=True)
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

    def _take_shard_fence(self, session: Session, end_stale: bool) -> FenceHolder | None:
        """store.take_fence with shards: the shard's key exclusively (a stale holder of our own group ended
        with `end_stale`), then the table's key and the N's key shared; none of it kept when an unsharded
        leader holds the table's key or a leader of another N holds its N's."""
        def apply() -> FenceHolder | None:
            if not self.db_fence:
                return None
            key = (session.shards, session.shard)
            holder = self.shard_fences.get(key)
            if holder is session:
                return None
            if holder is not None:
                same = holder.group == session.group
                if not same or not end_stale:
                    return FenceHolder(0, holder.owner, holder.group, "sim", same_group=same)
                self.world.note(f"fence: {session.owner} ends the session of stale {holder.owner}")
                self.drop(holder)
            table = self.fence_holder
            if table is not None:
                return FenceHolder(0, table.owner, table.group, "sim", same_group=table.group == session.group)
            other = next(((n, s) for n, holders in self.count_shared.items() if n != session.shards
                          for s in holders), None)
            if other is not None:
                n, other_session = other
                return FenceHolder(0, f"{other_session.owner} (sharded {n} ways)", other_session.group, "sim",
                                   same_group=False)
            self.shard_fences[key] = session
            self.table_shared[session] = None
            self.count_shared.setdefault(session.shards, {})[session] = None
            session.holds_fence = True
            previous = self.shard_terms.get(key)
            self.shard_terms[key] = (session.owner, False)
            # The store's own earlier session settled before this term began (the core waits for that).
            session.unsettled = (previous[0] if previous is not None and not previous[1]
                                 and previous[0] != session.owner else None)
            return None
        result = self._run(session, apply)
        if result is None:
            session.believes_fence = True
        return result  # type: ignore[return-value]

    def release_fence(self, session: Session, settled: bool = True) -> None:
        if self.fence_holder is session:
            self.fence_holder = None
        if session.shards > 1:
            key = (session.shards, session.shard)
            if settled and self.holds(session) and self.shard_terms.get(key, ("", False))[0] == session.owner:
                self.shard_terms[key] = (session.owner, True)
            self._let_go(session)
        session.holds_fence = session.believes_fence = False

    def holds(self, session: Session) -> bool:
        """Whether the session holds what its marks need: the table's fence, or its shard's (and the shared two)."""
        if session.shards <= 1:
            return self.fence_holder is session
        return (self.shard_fences.get((session.shards, session.shard)) is session and session in self.table_shared
                and session in self.count_shared.get(session.shards, {}))

    # -- the engine's statements ----------------------------------------------------------------

    def mark(self, session: Session, limit: int, after: int,
             gaps: Sequence[tuple[int, int]] = ()) -> tuple[list[Record], frozenset[str] | None]:
        """contract.WRITERS, MARK and GAPS in one round trip: the writers first, then the rows. As the
        store does, the writers are read only with gaps to look up (None otherwise)."""
        if not session.believes_fence:
            raise StatementFailed("the database fence was lost with its session")

        def apply() -> tuple[list[Record], frozenset[str] | None]:
            if self.db_fence and not self.holds(session):
                what = f"shard {session.shard} of {session.shards}" if session.shards > 1 else "the table"
                raise Violation(f"{session.owner} marked {what} without holding its fence")
            if session.shards > 1:
                self.marked_by[(session.shards, session.shard)] = session.owner
            writers = frozenset(self.writers) if gaps else None
            visible = sorted((r for r in self.rows.values() if r.committed and self.in_shard(r, session)),
                             key=lambda r: r.id)
            above = [r for r in visible if r.id > after][:limit]
            within = [r for r in visible if any(lo <= r.id <= hi for lo, hi in gaps)][:limit] if gaps else []
            return sorted((row.record() for row in above + within), key=lambda r: r.id), writers
        return self._run(session, apply)  # type: ignore[return-value]

    @staticmethod
    def in_shard(row: Row, session: Session) -> bool:
        """contract.reads(): a shard's store reads only its shard's rows."""
        return session.shards <= 1 or key_shard(row.key, session.shards) == session.shard

    def _fence_held(self, fence: Session | None) -> bool:
        if fence is not None and fence.shards > 1:
            return not self.db_fence or self.shard_fences.get((fence.shards, fence.shard)) is fence
        return fence is None or not self.db_fence or self.fence_holder is fence

    def purge(self, session: Session, ids: Sequence[int], fence: Session | None = None,
              durable: bool = True) -> tuple[int, bool]:
        """Delete acknowledged rows; not `durable`: committed asynchronously, undone by a crash until
        flushed (restart())."""
        def apply() -> tuple[int, bool]:
            removed = 0
            for row_id in ids:
                row = self.rows.get(row_id)
                if row is None:
                    continue
                if not self.published(row_id):
                    raise Violation(f"row {row_id} was purged before Kafka had it")
                del self.rows[row_id]
                if not durable:
                    self.unflushed.append((self.world.now, row))
                removed += 1
            if durable and removed:
                self.unflushed.clear()  # its commit waits for the flush (one that deleted nothing writes none)
            return removed, self._fence_held(fence)
        return self._run(session, apply)  # type: ignore[return-value]

    def reset(self, session: Session, ids: Sequence[int], errors: Sequence[str] = (),
              fence: Session | None = None) -> tuple[int, bool]:
        def apply() -> tuple[int, bool]:
            count = 0
            for index, row_id in enumerate(ids):
                row = self.rows.get(row_id)
                if row is None:
                    continue
                row.reset_count += 1
                row.last_error = errors[index] if index < len(errors) else None
                row.version = next(self._versions)
                count += 1
            return count, self._fence_held(fence)
        return self._run(session, apply)  # type: ignore[return-value]

    def hold(self, session: Session, row_id: int, reason: str = "") -> int | None:
        def apply() -> int | None:
            row = self.rows.get(row_id)
            if row is None:
                return None
            row.reset_count += 1
            row.last_error = reason
            row.version = next(self._versions)
            return row.version
        return self._run(session, apply)  # type: ignore[return-value]

    def check_held(self, session: Session, ids: Sequence[int]) -> dict[int, Record]:
        def apply() -> dict[int, Record]:
            return {i: self.rows[i].record() for i in ids if i in self.rows}
        return self._run(session, apply)  # type: ignore[return-value]

    def park(self, session: Session, record: Record, reason: str = "") -> bool:
        def apply() -> bool:
            row = self.rows.get(record.id)
            if row is None or row.version != record.version:
                return False  # gone, or changed since it failed (an operator's fix): not parked
            del self.rows[record.id]
            self.parked.add(record.id)
            self.dead_letters.append((row, reason))
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


class MemoryStore:
    """The engine's Store over the in-memory table, as one replica sees it: a fence session (the
    fence, marks, held rows, parking) and a purge session (purges, resets, holds), each replaced by
    a new one (holding no lock) when it ended, as the real store reconnects."""

    table_oid = 1
    partitioned = False

    def __init__(self, table: MemoryTable, owner: str, group: str, *,
                 reachable: Callable[[], bool] = lambda: True, shards: int = 1, shard: int = 0) -> None:
        self.table = table
        self.owner = owner
        self.group = group
        self._reachable = reachable
        #: This store's shard of the table (store.PostgresStore's shards and shard).
        self.shards, self.shard = shards, shard
        self.fence = Session(owner, group, shards=shards, shard=shard)
        self.purger = Session(owner, group, shards=shards, shard=shard)
        #: After a take_fence() that took the fence: the shard's previous leader, if it did not settle.
        self.unsettled_predecessor: str | None = None

    def _session(self, fence: bool) -> Session:
        current = self.fence if fence else self.purger
        if not current.alive:
            current = Session(self.owner, self.group, shards=self.shards, shard=self.shard)
            if fence:
                self.fence = current
            else:
                self.purger = current
        return current

    def _run(self, fence: bool, statement: Callable[[Session], object]) -> object:
        if not self._reachable():
            raise psycopg.OperationalError("database unreachable")
        try:
            return statement(self._session(fence))
        except StatementFailed as error:
            raise psycopg.OperationalError(str(error)) from None

    def take_fence(self, *, end_stale: bool = True) -> str | FenceHolder | None:
        self.unsettled_predecessor = None
        holder = self._run(True, lambda session: self.table.take_fence(session, end_stale))
        if holder is None:
            self.unsettled_predecessor, self.fence.unsettled = self.fence.unsettled, None
        return holder  # type: ignore[return-value]

    def release_fence(self, *, settled: bool = True) -> None:
        self._run(True, lambda session: self.table.release_fence(session, settled))

    def mark(self, limit: int, after: int,
             gaps: Sequence[tuple[int, int]] = ()) -> tuple[list[Record], frozenset[str] | None]:
        return self._run(True, lambda s: self.table.mark(s, limit, after, gaps))  # type: ignore[return-value]

    def check_held(self, ids: Sequence[int]) -> dict[int, Record]:
        return self._run(True, lambda s: self.table.check_held(s, ids))  # type: ignore[return-value]

    def park(self, record: Record, reason: str, attempts: int, parked_by: str, dead_letter_topic: str | None) -> bool:
        return bool(self._run(True, lambda s: self.table.park(s, record, reason)))

    def purge(self, ids: Sequence[int], read_fence: bool = True, durable: bool = True) -> tuple[int, bool]:
        fence = self.fence if read_fence else None  # None: not read (answers held)
        return self._run(False, lambda s: self.table.purge(s, ids, fence, durable))  # type: ignore[return-value]

    def reset(self, ids: Sequence[int], errors: Sequence[str]) -> tuple[int, bool]:
        return self._run(False, lambda s: self.table.reset(s, ids, errors, self.fence))  # type: ignore[return-value]

    def hold(self, record_id: int, reason: str) -> int | None:
        return self._run(False, lambda s: self.table.hold(s, record_id, reason))  # type: ignore[return-value]

    def has_notify_trigger(self) -> bool:
        return False

    def close(self) -> None:
        """The connections close: the fence, if held, goes with its session."""
        self.table.drop(self.fence)
        self.table.drop(self.purger)
