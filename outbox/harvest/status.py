"""Each replica's status row: who it is, whether it leads, what it has in flight and holds.

The row is upserted every `status_interval` seconds on a connection of its own, so writing it
never waits on harvesting (or the reverse); the admin dashboard, metrics and `harvest_health`
read it. Rows not seen for `status_prune_after` seconds are deleted by whichever replica notices.
A standby also says, once, who leads its group.

Every `history_interval` seconds the same thread also adds a sample of the replica's figures to
`<status_table>_history` (the dashboard's charts) and deletes samples older than `history_retention`:
the engine's loop never waits on it, and it costs Postgres two index lookups and an insert. A sample
carries what harvesting has cost the database (dbtime.py): this replica's round trips, and, from the
leader where the database has pg_stat_statements, the server's time for each kind of statement
(read by the harvester's query ids; their texts, which cost more to read, every ten minutes).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from outbox.harvest import dbtime, retention
from outbox.harvest.config import HarvestConfig
from outbox.harvest.contract import HeldRecord, ReplicaState
from outbox.harvest.retention import DeadLetterRetention
from outbox.harvest.store import close_quietly, connect, table_identifier, table_name
from outbox.reasons import first_line

if TYPE_CHECKING:
    from outbox.harvest.core import Snapshot

log = logging.getLogger("outbox.harvest")


@dataclass(frozen=True)
class StatusSnapshot:
    """What a replica reports about itself at one moment."""

    state: ReplicaState
    #: The leader id of the term its records in flight belong to (see core.Snapshot.marking_id).
    leader_id: object
    since: datetime
    in_flight: int
    queued: int
    in_flight_keys: list[str]
    in_flight_key_count: int
    #: Held (poison) records.
    held: list[HeldRecord]
    blocked_by: str | None
    throughput: float
    published: int
    failed: int
    #: The highest outbox id its term has read (None: no term with records).
    marked_upto: int | None = None
    #: Its database round trips since it started, by kind (dbtime.RoundTrips).
    round_trips: dbtime.Totals = field(default_factory=dict)


UPSERT = """
INSERT INTO {table} (name, host, pid, state, leader_id, marked_upto, since, started, last_seen, harvested_table,
                     leader_topic, leader_group, in_flight, queued, in_flight_keys, in_flight_key_count, held_keys,
                     held, blocked_by, throughput, published, failed)
VALUES (%(name)s, %(host)s, %(pid)s, %(state)s, %(leader_id)s, %(marked_upto)s, %(since)s, %(started)s, now(),
        %(harvested_table)s, %(leader_topic)s, %(leader_group)s, %(in_flight)s, %(queued)s, %(in_flight_keys)s,
        %(in_flight_key_count)s, %(held_keys)s, %(held)s, %(blocked_by)s, %(throughput)s, %(published)s, %(failed)s)
ON CONFLICT (name) DO UPDATE SET
  host = EXCLUDED.host, pid = EXCLUDED.pid, state = EXCLUDED.state, leader_id = EXCLUDED.leader_id,
  marked_upto = EXCLUDED.marked_upto,
  since = EXCLUDED.since, last_seen = now(), harvested_table = EXCLUDED.harvested_table,
  leader_topic = EXCLUDED.leader_topic, leader_group = EXCLUDED.leader_group, in_flight = EXCLUDED.in_flight,
  queued = EXCLUDED.queued, in_flight_keys = EXCLUDED.in_flight_keys,
  in_flight_key_count = EXCLUDED.in_flight_key_count, held_keys = EXCLUDED.held_keys, held = EXCLUDED.held,
  blocked_by = EXCLUDED.blocked_by, throughput = EXCLUDED.throughput, published = EXCLUDED.published,
  failed = EXCLUDED.failed
"""
# A shard's engine says which shard it harvests, where the status table has the columns (migration 0008).
SET_SHARD = "UPDATE {table} SET shard = %(shard)s, shards = %(shards)s WHERE name = %(name)s"
HAS_SHARD_COLUMNS = """
SELECT count(*) = 2 FROM pg_attribute
WHERE attrelid = to_regclass(%(table)s) AND attname IN ('shard', 'shards') AND NOT attisdropped
"""
PRUNE = "DELETE FROM {table} WHERE last_seen < now() - make_interval(secs => %(age)s)"
# A clean stop keeps the row, saying so (and when: last_seen), until it is pruned like any other.
STOPPED = """
UPDATE {table} SET state = 'stopped', since = now(), last_seen = now(), leader_id = NULL, marked_upto = NULL,
  in_flight = 0, queued = 0, in_flight_keys = '{{}}', in_flight_key_count = 0, throughput = 0
WHERE name = %(name)s AND pid = %(pid)s AND host = %(host)s
"""
# A shard's engine that stops leaves no row: its shard moved, or its replica (whose own row stays) stopped.
FORGET = "DELETE FROM {table} WHERE name = %(name)s AND pid = %(pid)s AND host = %(host)s"
LEADERS = """
SELECT name, host FROM {table}
WHERE leader_group = %(group)s AND state = 'leader' AND name <> %(name)s
  AND last_seen > now() - make_interval(secs => %(age)s)
"""
# Replicas of this group harvesting another table: two outboxes share a leader group, and only one
# of them can ever be harvested.
OTHER_TABLES = """
SELECT name, host, harvested_table FROM {table}
WHERE leader_group = %(group)s AND harvested_table <> %(harvested)s AND state <> 'stopped'
  AND last_seen > now() - make_interval(secs => %(age)s)
"""
# A live-row estimate for the harvested table, kept by Postgres's statistics: no table scan.
BACKLOG = "SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = to_regclass(%(table)s)"
#: Samples count the harvested table's rows exactly up to this many (a primary-key range), then estimate.
HISTORY_COUNT_LIMIT = 10_000
# One sample: the snapshot's figures, the table's rows (counted along the primary key up to the
# limit, Postgres's estimate beyond) and its oldest row's age (the primary key's head).
SAMPLE = """
WITH counted AS (SELECT count(*) AS n FROM (SELECT 1 FROM {table} ORDER BY id LIMIT %(count_limit)s + 1) head),
     oldest AS (SELECT create_time FROM {table} ORDER BY id LIMIT 1)
INSERT INTO {history} (name, at, state, leader_id, since, harvested_table, leader_group, published, failed, in_flight,
                       queued, held, backlog, oldest_age{cost_columns})
SELECT %(name)s, now(), %(state)s, %(leader_id)s, %(since)s, %(harvested_table)s, %(leader_group)s, %(published)s,
       %(failed)s, %(in_flight)s, %(queued)s, %(held)s,
       CASE WHEN n <= %(count_limit)s THEN n
            ELSE greatest(n, (SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = to_regclass(%(table_name)s)))
       END,
       extract(epoch FROM now() - (SELECT create_time FROM oldest)){cost_values}
FROM counted
"""
#: What the database paid, in a sample of a history table that has the columns (migration 0006).
COST_COLUMNS = ", db_round_trips, db_statements"
COST_VALUES = ", %(db_round_trips)s, %(db_statements)s"
STATEMENTS_INSTALLED = "SELECT to_regclass('pg_stat_statements') IS NOT NULL"
HAS_COST_COLUMNS = """
SELECT count(*) = 2 FROM pg_attribute
WHERE attrelid = to_regclass(%(table)s) AND attname IN ('db_round_trips', 'db_statements') AND NOT attisdropped
"""
PRUNE_HISTORY = "DELETE FROM {history} WHERE at < now() - make_interval(secs => %(age)s)"


def snapshot_of(core: Snapshot, *, stopping: bool, since: datetime, throughput: float,
                round_trips: dbtime.Totals) -> StatusSnapshot:
    """What an engine reports, from its core's snapshot (`stopping`: asked to stop, settling): Harvester.status,
    and the simulator's engines."""
    return StatusSnapshot(state=ReplicaState.STOPPING if stopping else core.state, leader_id=core.marking_id,
                          since=since, in_flight=core.in_flight, queued=core.queued,
                          in_flight_keys=core.in_flight_keys, in_flight_key_count=core.in_flight_key_count,
                          held=core.held, blocked_by=core.fence_holder, throughput=throughput,
                          published=core.published, failed=core.failed, marked_upto=core.marked_upto,
                          round_trips=round_trips)


def identity(config: HarvestConfig, started: datetime, *, host: str | None = None,
             pid: int | None = None) -> dict[str, object]:
    """Who writes a status row: the replica or engine `config` names, on this host and process by default."""
    return {"name": config.name, "host": host or socket.gethostname(), "pid": os.getpid() if pid is None else pid,
            "started": started, "harvested_table": config.table, "leader_topic": config.leader_topic,
            "leader_group": config.leader_group}


def shard_columns(config: HarvestConfig, sharded_replica: bool = False) -> dict[str, int | None] | None:
    """SET_SHARD's values: a shard's engine says its shard, a sharded replica's own row none; None unsharded."""
    if config.shards <= 1:
        return None
    return {"shard": None if sharded_replica else config.shard, "shards": config.shards}


def row_values(identity: dict[str, object], snapshot: StatusSnapshot) -> dict[str, object]:
    """The status row's values (UPSERT's parameters) for a replica or engine (`identity`: name, host, pid, started,
    harvested_table, leader_topic, leader_group) reporting `snapshot`."""
    return {
        **identity, "state": str(snapshot.state), "leader_id": snapshot.leader_id,
        "marked_upto": snapshot.marked_upto, "since": snapshot.since,
        "in_flight": snapshot.in_flight, "queued": snapshot.queued, "in_flight_keys": snapshot.in_flight_keys,
        "in_flight_key_count": snapshot.in_flight_key_count,
        "held_keys": [f"{held.key}: {held.reason}" for held in snapshot.held],
        "held": json.dumps([held.as_json() for held in snapshot.held]),
        "blocked_by": snapshot.blocked_by, "throughput": snapshot.throughput, "published": snapshot.published,
        "failed": snapshot.failed,
    }


def history_table(status_table: str) -> str:
    """The history table beside a status table: `outbox_harvester` -> `outbox_harvester_history`."""
    return f"{status_table}_history"


def status_table_exists(conn: psycopg.Connection, table: str) -> bool:
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL", [table_name(table)]).fetchone()[0]


class StatusReporter(threading.Thread):
    """Upserts this replica's status row every `status_interval` seconds until stopped, then marks it stopped."""

    def __init__(self, config: HarvestConfig, *, snapshot: Callable[[], StatusSnapshot],
                 on_backlog: Callable[[int], None], started: datetime | None = None,
                 sharded_replica: bool = False) -> None:
        """With shards, each engine reports its shard's row (deleted when the engine stops: the shard moved
        or the replica stopped), and the replica itself a row of its own (`sharded_replica`: no shard, no
        history), which says it is in the group whether it leads shards or not."""
        super().__init__(name="outbox-status", daemon=True)
        self._dsn = config.dsn
        ident = table_identifier(config.status_table)
        self._upsert = sql.SQL(UPSERT).format(table=ident)
        self._set_shard = sql.SQL(SET_SHARD).format(table=ident)
        self._status_table = table_name(config.status_table)
        self._shard = shard_columns(config, sharded_replica)
        self._engine_row = config.shards > 1 and not sharded_replica
        self._sharded_replica = sharded_replica
        self._forget = sql.SQL(FORGET).format(table=ident)
        self._shard_columns: bool | None = None
        self._prune = sql.SQL(PRUNE).format(table=ident)
        self._stopped = sql.SQL(STOPPED).format(table=ident)
        self._leaders = sql.SQL(LEADERS).format(table=ident)
        self._other_tables = sql.SQL(OTHER_TABLES).format(table=ident)
        self._shared_said: set[str] = set()
        self._identity = identity(config, started or datetime.now(UTC))
        self._group = config.leader_group
        self._harvested = table_name(config.table)
        self._interval = config.limits.status_interval
        self._prune_after = config.status_prune_after
        self._gone_after = max(4 * self._interval, 10.0)
        self._snapshot = snapshot
        self._on_backlog = on_backlog
        self._history_table = history_table(config.status_table) if config.status_table else None
        self._history_interval = config.limits.history_interval
        self._history_retention = config.history_retention
        history = table_identifier(self._history_table or "unused")
        harvested = table_identifier(config.table)
        self._sample = sql.SQL(SAMPLE.format(table="{table}", history="{history}", cost_columns="", cost_values="")
                               ).format(table=harvested, history=history)
        self._sample_costs = sql.SQL(SAMPLE.format(table="{table}", history="{history}", cost_columns=COST_COLUMNS,
                                                   cost_values=COST_VALUES)).format(table=harvested, history=history)
        self._prune_history = sql.SQL(PRUNE_HISTORY).format(history=history)
        self._history_on: bool | None = (None if self._history_table and self._history_interval and not sharded_replica
                                         else False)
        self._history_costs = False
        self._history_failing = False
        # The server's time per statement kind (pg_stat_statements), read by the leader with each sample.
        # Its own statements count as `status`: the status rows, the history, the dead letters' retention.
        own = [statement.as_string() for statement in (self._upsert, self._set_shard, self._forget, self._prune,
                                                       self._stopped,
                                                       self._leaders,
                                                       self._other_tables, self._sample, self._sample_costs,
                                                       self._prune_history)]
        if config.dead_letter_table:
            own.append(sql.SQL(retention.PRUNE).format(table=table_identifier(config.dead_letter_table)).as_string())
        statements = {**dbtime.engine_statements(config.table, config.dead_letter_table, config.shards),
                      **{text: "status" for text in [*own, BACKLOG]}}
        self._server_time = dbtime.ServerTime(dbtime.StatementKinds(statements), dbtime.server_patterns(
            [config.table, config.status_table, self._history_table or config.status_table,
             *([config.dead_letter_table] if config.dead_letter_table else [])]))
        self._statements_on: bool | None = None
        #: The last read of the server's time per statement kind (None: not read, or not the leader).
        self.statements: dbtime.Totals | None = None
        self._next_sample = 0.0
        self.retention = DeadLetterRetention(config)
        self._stop_event = threading.Event()
        self._conn: psycopg.Connection | None = None
        self._failing = False
        self._standby_said: object = None  # the `since` of the standby spell already announced

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        while True:
            self._report()
            if self._stop_event.wait(self._interval):
                break
        try:
            self._connection().execute(self._forget if self._engine_row else self._stopped, self._identity)
        except psycopg.Error as error:
            log.debug("Could not mark the status row stopped: %s", first_line(error))
        conn, self._conn = self._conn, None
        close_quietly(conn)

    def sample(self, conn: psycopg.Connection, snapshot: StatusSnapshot) -> None:
        """A history sample when one is due, on someone else's session (status_board.py: a reporter not started,
        its row written by the board)."""
        self._add_sample(conn, self._params(snapshot), len(snapshot.held), snapshot.round_trips)

    def _params(self, snapshot: StatusSnapshot) -> dict[str, object]:
        return row_values(self._identity, snapshot)

    def _report(self) -> None:
        snapshot = self._snapshot()
        params = self._params(snapshot)
        try:
            conn = self._connection()
            if self._shard is not None and self._shard_columns is None:
                self._shard_columns = conn.execute(HAS_SHARD_COLUMNS, {"table": self._status_table}).fetchone()[0]
                if not self._shard_columns:
                    log.warning("Status table %s has no shard columns (run manage.py migrate, or outbox-harvest "
                                "schema --apply --since 0007_history_database_time): the dashboard cannot tell "
                                "this engine's shard", self._status_table)
            with conn.transaction():
                conn.execute(self._upsert, params)
                if self._shard is not None and self._shard_columns:
                    conn.execute(self._set_shard, {**self._shard, "name": params["name"]})
                conn.execute(self._prune, {"age": self._prune_after})
            row = conn.execute(BACKLOG, {"table": self._harvested}).fetchone()
            if row is not None:
                self._on_backlog(int(row[0]))
            self._add_sample(conn, params, len(snapshot.held), snapshot.round_trips)
            self.retention.run(conn, snapshot.state is ReplicaState.LEADER)
            if snapshot.state is ReplicaState.STANDBY and self._standby_said != snapshot.since \
                    and not self._shard:
                self._say_who_leads(conn, snapshot)
            self._say_if_group_shared(conn)
            if self._failing:
                log.info("Status reporting resumed")
            self._failing = False
        except psycopg.Error as error:
            if not self._failing:  # say it once, not every interval
                log.warning("Status row not written (harvesting goes on): %s", first_line(error))
            self._failing = True
            conn, self._conn = self._conn, None
            close_quietly(conn)

    def _read_statements(self, conn: psycopg.Connection) -> dbtime.Totals | None:
        """The server's time per statement kind, or None where pg_stat_statements cannot be read (said once)."""
        if self._statements_on is False:
            return None
        why = "the extension is not installed in this database"
        try:
            if self._statements_on or conn.execute(STATEMENTS_INSTALLED).fetchone()[0]:
                found = self._server_time.read(conn)
                self._statements_on = True
                return found
        except psycopg.Error as error:
            if conn.broken:
                raise  # the status row's own handler says so once and reconnects
            why = first_line(error)
        log.info("The database's time per statement is not recorded (the round trips are): pg_stat_statements: %s",
                 why)
        self._statements_on = False
        return None

    def _add_sample(self, conn: psycopg.Connection, params: dict[str, object], held: int,
                    round_trips: dbtime.Totals) -> None:
        """Every history_interval: one sample, and samples older than history_retention deleted."""
        if self._history_on is False or time.monotonic() < self._next_sample:
            return
        if self._history_on is None:
            self._history_on = status_table_exists(conn, self._history_table)
            if not self._history_on:
                log.info("History off: table %s does not exist (manage.py migrate creates it)", self._history_table)
                return
            self._history_costs = conn.execute(HAS_COST_COLUMNS,
                                               {"table": table_name(self._history_table)}).fetchone()[0]
        self._next_sample = time.monotonic() + self._history_interval
        statements = self._read_statements(conn) if params["state"] == ReplicaState.LEADER else None
        self.statements = statements
        costs = {"db_round_trips": Jsonb(dbtime.as_json(round_trips)),
                 "db_statements": None if statements is None else Jsonb(dbtime.as_json(statements))}
        try:
            with conn.transaction():
                conn.execute(self._sample_costs if self._history_costs else self._sample,
                             {**params, **costs, "held": held, "count_limit": HISTORY_COUNT_LIMIT,
                              "table_name": self._harvested})
                conn.execute(self._prune_history, {"age": self._history_retention})
        except psycopg.Error as error:
            if conn.broken:
                raise  # the status row's own handler says so once and reconnects
            if not self._history_failing:  # say it once, not every interval
                log.warning("History sample not written (harvesting goes on): %s", first_line(error))
            self._history_failing = True
            return
        self._history_failing = False

    def _say_who_leads(self, conn: psycopg.Connection, snapshot: StatusSnapshot) -> None:
        leaders = conn.execute(self._leaders, {"group": self._group, "name": self._identity["name"],
                                               "age": self._gone_after}).fetchall()
        if leaders:
            who = ", ".join(f"{name} on {host}" for name, host in leaders)
            log.info("Standing by: %s leads group %s", who, self._group)
            self._standby_said = snapshot.since
        elif self._standby_said is None:
            log.info("Standing by in group %s (no leader seen yet)", self._group)
            self._standby_said = "announced-no-leader"

    def _say_if_group_shared(self, conn: psycopg.Connection) -> None:
        others = conn.execute(self._other_tables, {"group": self._group, "harvested": self._identity["harvested_table"],
                                                   "age": self._gone_after}).fetchall()
        for name, host, table in others:
            if table not in self._shared_said:
                self._shared_said.add(table)
                log.error("Leader group %s is shared with replica %s on %s, which harvests table %s: only one of the "
                          "two tables can be harvested. Give each outbox its own leader group (the default derives "
                          "one from the database and table).", self._group, name, host, table)

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self._dsn, "status")
        return self._conn
