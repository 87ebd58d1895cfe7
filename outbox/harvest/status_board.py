"""One status writer per status table for every engine of a process (an outbox's, each shard's and the
sharded replica's own row, each of many outboxes').

A session and a thread per engine would be fifty sessions for fifty idle outboxes. A board writes every engine's
row in one statement each `status_interval` on one session, reads the harvested tables' backlogs every
BACKLOG_EVERY intervals and prunes stale rows every PRUNE_INTERVAL; per engine it also runs the history samples
and standby's lines (status.py) and the leader's dead-letter retention (retention.py). It starts with its first
engine and ends once its last one's row says stopped:

    boards = StatusBoards()                                           # the process's
    reporter = boards.reporter(engine_config, snapshot, on_backlog)   # start(), close(), statements
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from outbox.harvest import dbtime
from outbox.harvest.config import HarvestConfig
from outbox.harvest.contract import ReplicaState
from outbox.harvest.process_services import ProcessServices
from outbox.harvest.retention import PASS_INTERVAL, DeadLetterRetention
from outbox.harvest.status import (
    FORGET,
    HAS_COLUMNS,
    LEADERS,
    OTHER_TABLES,
    PRUNE,
    ROW_COLUMNS,
    STOPPED,
    HistorySampler,
    StandbyNotes,
    StatusSnapshot,
    identity,
    row_values,
    shard_columns,
    status_table_exists,
)
from outbox.harvest.store import STATUS_TABLE, close_quietly, connect, how_made, table_identifier, table_name
from outbox.logs import SaidOnce
from outbox.reasons import first_line

log = logging.getLogger("outbox.harvest")

BACKLOG_EVERY = 5
PRUNE_INTERVAL = 60.0
#: Seconds between a leader's passes over its expired dead letters, for an outbox among many (retention is counted in
#: days; retention.PASS_INTERVAL for one outbox).
RETENTION_INTERVAL = 600.0


def _upsert_many(shards: bool) -> str:
    """Every engine's row in one statement, as a JSON array typed by the table's own row type; with `shards`, each
    engine's shard too (a table with the columns). A row already there (by name) keeps its `started`."""
    columns = [*ROW_COLUMNS, *(("shard", "shards") if shards else ())]
    listed = ", ".join(columns)
    updated = ", ".join(f"{column} = {'now()' if column == 'last_seen' else f'EXCLUDED.{column}'}"
                        for column in columns if column not in ("name", "started"))
    return (f"INSERT INTO {{table}} ({listed})\nSELECT {listed.replace('last_seen', 'now()')}\n"
            f"FROM jsonb_populate_recordset(NULL::{{table}}, %(rows)s)\nON CONFLICT (name) DO UPDATE SET {updated}\n")


UPSERT_MANY = _upsert_many(shards=False)
UPSERT_MANY_SHARDS = _upsert_many(shards=True)
# Every harvested table's live-row estimate in one statement.
BACKLOGS = """
SELECT t.name, s.n_live_tup FROM unnest(%(tables)s::text[]) AS t(name)
JOIN pg_stat_user_tables s ON s.relid = to_regclass(t.name)
"""
#: The shard columns of an unsharded engine's row (their defaults), beside sharded ones on one board.
UNSHARDED = {"shard": None, "shards": 1}


def board_row(values: dict[str, Any], shard: dict[str, int | None] | None = None) -> dict[str, Any]:
    """A status row (status.row_values, status.shard_columns) as JSON, as UPSERT_MANY(_SHARDS) reads it."""
    leader_id = values["leader_id"]
    return {**values, "started": values["started"].isoformat(), "since": values["since"].isoformat(),
            "leader_id": None if leader_id is None else str(leader_id), "held": json.loads(values["held"]),
            "in_flight_keys": list(values["in_flight_keys"]), **(shard or UNSHARDED)}


def writer_statements(status_table: str) -> list[str]:
    """The board's statements on `status_table` as it sends them (counted as `status` in a sample)."""
    ident = table_identifier(status_table)
    return [sql.SQL(text).format(table=ident).as_string() for text in (PRUNE, STOPPED, FORGET, LEADERS, OTHER_TABLES,
                                                                       UPSERT_MANY, UPSERT_MANY_SHARDS, BACKLOGS)]


class BoardReporter:
    """One engine's place on the board: start() attaches it, close() detaches it once its last row is written."""

    def __init__(self, boards: StatusBoards, config: HarvestConfig, snapshot: Callable[[], StatusSnapshot],
                 on_backlog: Callable[[int], None], *, sharded_replica: bool = False,
                 one_of_many: bool = False) -> None:
        """With shards, each shard's engine has a row (deleted when it stops: the shard moved or the replica
        stopped), and the replica one of its own (`sharded_replica`: no shard, no history), in the group whether it
        leads shards or not. `one_of_many`: an outbox among many: no standby's lines, retention every
        RETENTION_INTERVAL."""
        self._boards = boards
        self.config = config
        #: The board it is on, from start().
        self.board: StatusBoard | None = None
        self.table = table_name(config.table)
        self.identity = identity(config, datetime.now(UTC))
        self.snapshot = snapshot
        self.on_backlog = on_backlog
        #: Its shard columns' values (None unsharded), and whether its row goes when it stops (a shard's engine's).
        self.shard = shard_columns(config, sharded_replica)
        self.forget = config.shards > 1 and not sharded_replica
        self.retention = DeadLetterRetention(config, pass_interval=RETENTION_INTERVAL if one_of_many
                                             else PASS_INTERVAL)
        self.sampler = (HistorySampler(config, self.identity, writer_statements(config.status_table))
                        if config.limits.history_interval and not sharded_replica else None)
        #: A replica's own lines (not a shard's engine's).
        self.notes = StandbyNotes(config, self.identity) if not (one_of_many or self.forget) else None
        self._gone = threading.Event()

    @property
    def statements(self) -> dbtime.Totals | None:
        """The leader's last read of pg_stat_statements (None without history samples)."""
        return self.sampler.statements if self.sampler is not None else None

    def start(self) -> None:
        self.board = self._boards.attach(self)

    def close(self, timeout: float | None = 10.0) -> None:
        """Leave the board, and wait (up to `timeout`) until it wrote the row as stopped (or deleted it)."""
        board, self.board = self.board, None
        if board is not None:
            board.detach(self)
            self._gone.wait(timeout)

    def row(self) -> dict[str, Any]:
        """The engine's row as the board's upsert reads it."""
        return board_row(row_values(self.identity, self.snapshot()), self.shard)


class StatusBoard(threading.Thread):
    """Writes the status rows of every engine attached, for one status table, on one session."""

    def __init__(self, config: HarvestConfig, *, name: str = "",
                 on_empty: Callable[[StatusBoard], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`on_empty` is told when the last engine left (StatusBoards then ends the board); `clock` times the
        pruning of stale rows."""
        super().__init__(name="outbox-status-board", daemon=True)
        self._dsn = config.dsn
        self._clock = clock
        self._name = name
        self._on_empty = on_empty
        self._status_table = config.status_table
        ident = table_identifier(config.status_table)
        self._upsert, self._upsert_shards, self._prune, self._stopped, self._forget = (
            sql.SQL(text).format(table=ident) for text in (UPSERT_MANY, UPSERT_MANY_SHARDS, PRUNE, STOPPED, FORGET))
        #: Whether the status table has the shard columns (asked once an engine with a shard attaches).
        self._shard_columns: bool | None = None
        self._interval = config.limits.status_interval
        self._prune_after = config.status_prune_after
        self._lock = threading.Lock()
        self._reporters: list[BoardReporter] = []
        self._leaving: list[BoardReporter] = []
        self._wake = threading.Event()
        self._stop_event = threading.Event()
        self._conn: psycopg.Connection | None = None
        self._outage = SaidOnce(log, "Status rows not written (harvesting goes on): %s", "Status reporting resumed")
        self._writes = 0
        self._pruned_at = float("-inf")
        self._ended = False

    def usable(self) -> bool:
        """Whether the status table is there (else status rows are off, said once by the caller). A database
        that cannot say now (too many clients, a restart) counts as yes: the board's writes retry, and warn
        once, rather than turn every engine's status row off for the process's life."""
        try:
            return status_table_exists(self._connection(), self._status_table)
        except psycopg.Error as error:
            log.warning("Status rows: cannot tell yet whether table %s exists (written when it can): %s",
                        self._status_table, first_line(error))
            self._close_session()
            return True

    def _close_session(self) -> None:
        conn, self._conn = self._conn, None
        close_quietly(conn)

    def attach(self, reporter: BoardReporter) -> StatusBoard:
        with self._lock:
            self._reporters.append(reporter)
        self._wake.set()  # its first row at once
        return self

    def detach(self, reporter: BoardReporter) -> None:
        with self._lock:
            if reporter in self._reporters:
                self._reporters.remove(reporter)
            self._leaving.append(reporter)
            empty = not self._reporters
        self._wake.set()
        if empty and self._on_empty is not None:
            self._on_empty(self)

    @property
    def empty(self) -> bool:
        """Whether no engine is attached."""
        with self._lock:
            return not self._reporters

    def stop(self) -> None:
        self._stop_event.set()
        self._wake.set()

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                self._wake.clear()
                self.step()
                self._wake.wait(self._interval)
        finally:
            self.end()

    def step(self) -> None:
        """One round of rows (the thread's, every status_interval and at once when an engine comes or goes). A
        surprise (a bug of ours) costs one round of rows, not every engine's status from now on."""
        try:
            self._write()
        except Exception:
            log.exception("Status rows not written")

    def end(self) -> None:
        """The last round (the last engines to leave say stopped), every engine waiting on its row released, the
        session closed: the thread's last act, or its owner's for a board it steps itself."""
        if self._ended:
            return
        self._ended = True
        try:
            self.step()
        finally:
            with self._lock:
                leaving, self._leaving = self._leaving + self._reporters, []
            for reporter in leaving:
                reporter._gone.set()
            self._close_session()

    def _write(self) -> None:
        with self._lock:
            reporters, leaving, self._leaving = list(self._reporters), self._leaving, []
        try:
            conn = self._connection()
            # The leaving first: an engine started again in this process has the same name, pid and host,
            # and its new row must not be overwritten as stopped.
            for reporter in leaving:
                conn.execute(self._forget if reporter.forget else self._stopped, reporter.identity)
            if reporters:
                upsert = self._upsert_shards if self._with_shards(conn, reporters) else self._upsert
                conn.execute(upsert, {"rows": Jsonb([reporter.row() for reporter in reporters])})
                self._writes += 1
                if self._writes % BACKLOG_EVERY == 1:
                    self._read_backlogs(conn, reporters)
                for reporter in reporters:
                    snapshot = reporter.snapshot()
                    reporter.retention.run(conn, snapshot.state is ReplicaState.LEADER)
                    if reporter.sampler is not None:
                        reporter.sampler.sample(conn, snapshot)
                    if reporter.notes is not None:
                        reporter.notes.say(conn, snapshot)
            now = self._clock()
            if now - self._pruned_at >= PRUNE_INTERVAL:
                self._pruned_at = now
                conn.execute(self._prune, {"age": self._prune_after})
            self._outage.ended()
        except psycopg.Error as error:
            self._outage.failed(first_line(error))
            self._close_session()
        finally:
            for reporter in leaving:
                reporter._gone.set()

    def _with_shards(self, conn: psycopg.Connection, reporters: list[BoardReporter]) -> bool:
        """Whether the rows carry their shards: some engine has one, and the table has the columns (else said
        once)."""
        if not any(reporter.shard for reporter in reporters):
            return False
        if self._shard_columns is None:
            self._shard_columns = conn.execute(HAS_COLUMNS, {"table": table_name(self._status_table),
                                                             "first": "shard", "second": "shards"}).fetchone()[0]
            if not self._shard_columns:
                log.warning("Status table %s has no shard columns (run manage.py migrate, or outbox-harvest schema "
                            "--apply --since 0007_history_database_time): the dashboard cannot tell the engines' "
                            "shards", self._status_table)
        return self._shard_columns

    def _read_backlogs(self, conn: psycopg.Connection, reporters: list[BoardReporter]) -> None:
        found = dict(conn.execute(BACKLOGS, {"tables": sorted({r.table for r in reporters})}).fetchall())
        for reporter in reporters:
            rows = found.get(reporter.table)
            if rows is not None:
                reporter.on_backlog(int(rows))

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self._dsn, "status", name=self._name)
        return self._conn


class StatusBoards(ProcessServices[StatusBoard]):
    """The process's boards, one per status table (by database)."""

    def __init__(self, *, name: str = "", threads: bool = True) -> None:
        super().__init__(threads=threads)
        self._name = name

    def reporter(self, config: HarvestConfig, snapshot: Callable[[], StatusSnapshot],
                 on_backlog: Callable[[int], None], **kinds: bool) -> BoardReporter | None:
        """An engine's place on the board of `config`'s status table (BoardReporter's `kinds`), taken at its
        start(); None where status rows are off, or the table does not exist (said once)."""
        if not (config.status_table and config.limits.status_interval):
            return None
        if self._use(config, lambda board: board) is None:
            return None
        return BoardReporter(self, config, snapshot, on_backlog, **kinds)

    def attach(self, reporter: BoardReporter) -> StatusBoard | None:
        """Put `reporter` on its status table's board (started anew if the last one ended meanwhile)."""
        return self._use(reporter.config, lambda board: board.attach(reporter))

    def _use(self, config: HarvestConfig, use: Callable[[StatusBoard], StatusBoard]) -> StatusBoard | None:
        return self.use((config.dsn, config.status_table or ""), lambda: self._board(config), use)

    def _board(self, config: HarvestConfig) -> StatusBoard | None:
        board = StatusBoard(config, name=self._name, on_empty=self.retire)
        if board.usable():
            return board
        log.info("Status rows off: table %s does not exist (%s)", config.status_table,
                 how_made(config.status_table, STATUS_TABLE))
        board._close_session()
        return None
