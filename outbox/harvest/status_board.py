"""One status writer for every engine of a process that harvests many outboxes (outboxes.py).

A Harvester writes its status row on a session and thread of its own (status.py): a few statements
every `status_interval`. Fifty outboxes in a process would be fifty sessions and well over a hundred
statements a second, with nothing happening. The board writes every engine's row in one statement
per `status_interval` on one session (per status table), reads every harvested table's backlog in
one more every BACKLOG_EVERY intervals, and prunes stale rows every PRUNE_INTERVAL:

    board = StatusBoard(config); board.start()
    reporter = board.reporter(engine_config, snapshot, on_backlog)   # StatusReporter's interface for a Harvester

The rows are the same rows, read by the same dashboard, metrics and harvest_health. An engine whose
config has a `history_interval` also gets its history samples (the dashboard's charts; a leader's with
its read of pg_stat_statements) written here, by a StatusReporter that is never started (outbox/many.py
turns them off for tenant schemas' outboxes: fifty tenants would be five samples a second). What an
engine on the board does not do: the standby's one-off log lines (who leads, a group shared by two
tables). Parked records past `dead_letter_retention` are deleted by each outbox's leader, from here,
every RETENTION_INTERVAL.
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
from outbox.harvest.retention import DeadLetterRetention
from outbox.harvest.status import (
    PRUNE,
    STOPPED,
    UPSERT,
    StatusReporter,
    StatusSnapshot,
    identity,
    row_values,
    status_table_exists,
)
from outbox.harvest.store import close_quietly, connect, table_identifier, table_name
from outbox.reasons import first_line

log = logging.getLogger("outbox.harvest")

#: The backlog (Postgres's live-row estimate of each harvested table) is read every this many intervals.
BACKLOG_EVERY = 5
#: Rows not seen for status_prune_after are deleted this often (seconds).
PRUNE_INTERVAL = 60.0
#: Each leader's pass over its expired dead letters, this often (seconds): retention is counted in days.
RETENTION_INTERVAL = 600.0

_COLUMNS = UPSERT[UPSERT.index("(") + 1:UPSERT.index(")")]
_ON_CONFLICT = UPSERT[UPSERT.index("ON CONFLICT"):]
# Every engine's row in one statement: the rows as a JSON array, typed by the status table's own row type.
UPSERT_MANY = (f"INSERT INTO {{table}} ({_COLUMNS})\n"
               f"SELECT {_COLUMNS.replace('last_seen', 'now()')}\n"
               f"FROM jsonb_populate_recordset(NULL::{{table}}, %(rows)s)\n{_ON_CONFLICT}")
# Every harvested table's live-row estimate in one statement.
BACKLOGS = """
SELECT t.name, s.n_live_tup FROM unnest(%(tables)s::text[]) AS t(name)
JOIN pg_stat_user_tables s ON s.relid = to_regclass(t.name)
"""


class BoardReporter:
    """One engine's place on the board, with StatusReporter's interface (start, stop, join, is_alive)."""

    def __init__(self, board: StatusBoard, config: HarvestConfig, snapshot: Callable[[], StatusSnapshot],
                 on_backlog: Callable[[int], None]) -> None:
        self.board = board
        self.name = config.name
        self.table = table_name(config.table)
        self.identity = identity(config, datetime.now(UTC))
        self.snapshot = snapshot
        self.on_backlog = on_backlog
        self.retention = DeadLetterRetention(config, pass_interval=RETENTION_INTERVAL)
        #: The engine's history samples (the dashboard's charts), when its config asks for them
        #: (history_interval): a StatusReporter never started, whose samples the board writes.
        self.sampler = (StatusReporter(config, snapshot=snapshot, on_backlog=on_backlog)
                        if config.status_table and config.limits.history_interval else None)
        self._alive = False
        self._gone = threading.Event()

    @property
    def statements(self) -> dbtime.Totals | None:
        """The leader's last read of pg_stat_statements, taken with its history samples (None without)."""
        return self.sampler.statements if self.sampler is not None else None

    def start(self) -> None:
        self._alive = True
        self.board.attach(self)

    def stop(self) -> None:
        """Leave the board; its row says stopped once the board wrote that (join waits for it)."""
        self.board.detach(self)

    def join(self, timeout: float | None = None) -> None:
        self._gone.wait(timeout)
        self._alive = False

    def is_alive(self) -> bool:
        return self._alive

    def row(self) -> dict[str, Any]:
        """The engine's row as UPSERT_MANY reads it: status.row_values, its values as JSON."""
        values = row_values(self.identity, self.snapshot())
        leader_id = values["leader_id"]
        return {**values, "started": values["started"].isoformat(), "since": values["since"].isoformat(),
                "leader_id": None if leader_id is None else str(leader_id), "held": json.loads(values["held"]),
                "in_flight_keys": list(values["in_flight_keys"])}


class StatusBoard(threading.Thread):
    """Writes the status rows of every engine attached, for one status table, on one session."""

    def __init__(self, config: HarvestConfig, *, name: str = "") -> None:
        super().__init__(name="outbox-status-board", daemon=True)
        self._dsn = config.dsn
        self._name = name
        self._status_table = config.status_table
        ident = table_identifier(config.status_table)
        self._upsert = sql.SQL(UPSERT_MANY).format(table=ident)
        self._prune = sql.SQL(PRUNE).format(table=ident)
        self._stopped = sql.SQL(STOPPED).format(table=ident)
        self._interval = config.limits.status_interval
        self._prune_after = config.status_prune_after
        self._lock = threading.Lock()
        self._reporters: list[BoardReporter] = []
        self._leaving: list[BoardReporter] = []
        self._wake = threading.Event()
        self._stop_event = threading.Event()
        self._conn: psycopg.Connection | None = None
        self._failing = False
        self._writes = 0
        self._pruned_at = float("-inf")

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

    def attach(self, reporter: BoardReporter) -> None:
        with self._lock:
            self._reporters.append(reporter)
        self._wake.set()  # its first row at once, as a StatusReporter writes its own

    def detach(self, reporter: BoardReporter) -> None:
        with self._lock:
            if reporter in self._reporters:
                self._reporters.remove(reporter)
            self._leaving.append(reporter)
        self._wake.set()

    def stop(self) -> None:
        self._stop_event.set()
        self._wake.set()

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                self._wake.clear()
                self._write_safely()
                self._wake.wait(self._interval)
            self._write_safely()  # the last ones to leave say stopped
        finally:
            with self._lock:
                leaving, self._leaving = self._leaving + self._reporters, []
            for reporter in leaving:
                reporter._gone.set()
            self._close_session()

    def _write_safely(self) -> None:
        """A surprise (a bug of ours) costs one round of rows, not every engine's status from now on."""
        try:
            self._write()
        except Exception:
            log.exception("Status rows not written")

    def _write(self) -> None:
        with self._lock:
            reporters, leaving, self._leaving = list(self._reporters), self._leaving, []
        try:
            conn = self._connection()
            # The leaving first: an engine started again in this process has the same name, pid and host,
            # and its new row must not be overwritten as stopped.
            for reporter in leaving:
                conn.execute(self._stopped, reporter.identity)
            if reporters:
                conn.execute(self._upsert, {"rows": Jsonb([reporter.row() for reporter in reporters])})
                self._writes += 1
                if self._writes % BACKLOG_EVERY == 1:
                    self._read_backlogs(conn, reporters)
                for reporter in reporters:
                    snapshot = reporter.snapshot()
                    reporter.retention.run(conn, snapshot.state is ReplicaState.LEADER)
                    if reporter.sampler is not None:
                        reporter.sampler.sample(conn, snapshot)
            now = time.monotonic()
            if now - self._pruned_at >= PRUNE_INTERVAL:
                self._pruned_at = now
                conn.execute(self._prune, {"age": self._prune_after})
            if self._failing:
                log.info("Status reporting resumed")
            self._failing = False
        except psycopg.Error as error:
            if not self._failing:  # said once, not every interval
                log.warning("Status rows not written (harvesting goes on): %s", first_line(error))
            self._failing = True
            self._close_session()
        finally:
            for reporter in leaving:
                reporter._gone.set()

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


class StatusBoards:
    """The process's boards, one per status table (by database), started when first asked for."""

    def __init__(self, *, name: str = "") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._boards: dict[tuple[str, str], StatusBoard | None] = {}

    def board(self, config: HarvestConfig) -> StatusBoard | None:
        """The board of `config`'s status table; None (said once) where the table does not exist."""
        key = (config.dsn, config.status_table or "")
        with self._lock:
            if key not in self._boards:
                board = StatusBoard(config, name=self._name)
                if board.usable():
                    board.start()
                    self._boards[key] = board
                else:
                    log.info("Status rows off: table %s does not exist (manage.py migrate creates it)",
                             config.status_table)
                    board._close_session()
                    self._boards[key] = None
            return self._boards[key]

    def close(self) -> None:
        with self._lock:
            boards = [board for board in self._boards.values() if board is not None]
        for board in boards:
            board.stop()
        for board in boards:
            board.join(timeout=10)
