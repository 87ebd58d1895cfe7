"""Each replica's status row: who it is, whether it leads, what it has in flight and holds; read by the dashboard,
metrics and `harvest_health`, written by the process's status writer (status_board.py) every `status_interval`, so
writing never waits on harvesting (or the reverse). Rows not seen for `status_prune_after` seconds are deleted.

Every `history_interval` an engine also adds a sample of its figures to `<status_table>_history` (the dashboard's
charts: two index lookups and an insert) and deletes those older than `history_retention`. A leader's sample carries
what harvesting cost the database (dbtime.py): its round trips and, where the database has pg_stat_statements, the
server's time per kind of statement.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from outbox.harvest import dbtime, retention
from outbox.harvest.config import HarvestConfig
from outbox.harvest.contract import HeldRecord, ReplicaState
from outbox.harvest.store import STATUS_TABLE, how_made, table_identifier, table_name
from outbox.logs import SaidOnce
from outbox.reasons import first_line

if TYPE_CHECKING:
    from outbox.harvest.core import Snapshot

log = logging.getLogger("outbox.harvest")


@dataclass(frozen=True)
class StatusSnapshot:
    """What a replica reports of itself at one moment."""

    state: ReplicaState
    #: The leader id of the term its records in flight belong to (see core.Snapshot.marking_id).
    leader_id: object
    since: datetime
    in_flight: int
    queued: int
    in_flight_keys: list[str]
    in_flight_key_count: int
    held: list[HeldRecord]
    blocked_by: str | None
    throughput: float
    published: int
    failed: int
    #: The highest outbox id its term has read (None: no term with records).
    marked_upto: int | None = None
    #: Its database round trips since it started, by kind (dbtime.RoundTrips).
    round_trips: dbtime.Totals = field(default_factory=dict)


#: A status row's columns, as its writer sends them (status_board.py; last_seen is the server's now()).
ROW_COLUMNS = ("name", "host", "pid", "state", "leader_id", "marked_upto", "since", "started", "last_seen",
               "harvested_table", "leader_topic", "leader_group", "in_flight", "queued", "in_flight_keys",
               "in_flight_key_count", "held_keys", "held", "blocked_by", "throughput", "published", "failed")
# Whether a table has both columns: the status table's shard ones (migration 0008), the history table's costs (0006).
HAS_COLUMNS = """
SELECT count(*) = 2 FROM pg_attribute
WHERE attrelid = to_regclass(%(table)s) AND attname IN (%(first)s, %(second)s) AND NOT attisdropped
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
# Replicas of this group harvesting another table (only one of the two tables can be harvested).
OTHER_TABLES = """
SELECT name, host, harvested_table FROM {table}
WHERE leader_group = %(group)s AND harvested_table <> %(harvested)s AND state <> 'stopped'
  AND last_seen > now() - make_interval(secs => %(age)s)
"""
#: Samples count the harvested table's rows exactly up to this many (a primary-key range), then estimate.
HISTORY_COUNT_LIMIT = 10_000
# One sample: the snapshot's figures, the table's rows (HISTORY_COUNT_LIMIT) and its oldest row's age.
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
PRUNE_HISTORY = "DELETE FROM {history} WHERE at < now() - make_interval(secs => %(age)s)"


def snapshot_of(core: Snapshot, *, stopping: bool, since: datetime, throughput: float,
                round_trips: dbtime.Totals) -> StatusSnapshot:
    """What an engine reports, from its core's snapshot (`stopping`: asked to stop, settling)."""
    return StatusSnapshot(state=ReplicaState.STOPPING if stopping else core.state, leader_id=core.marking_id,
                          since=since, in_flight=core.in_flight, queued=core.queued,
                          in_flight_keys=core.in_flight_keys, in_flight_key_count=core.in_flight_key_count,
                          held=core.held, blocked_by=core.fence_holder, throughput=throughput,
                          published=core.published, failed=core.failed, marked_upto=core.marked_upto,
                          round_trips=round_trips)


def identity(config: HarvestConfig, started: datetime, *, host: str | None = None,
             pid: int | None = None) -> dict[str, object]:
    """Who writes a status row: `config`'s replica or engine, on this host and process by default."""
    return {"name": config.name, "host": host or socket.gethostname(), "pid": os.getpid() if pid is None else pid,
            "started": started, "harvested_table": config.table, "leader_topic": config.leader_topic,
            "leader_group": config.leader_group}


def shard_columns(config: HarvestConfig, sharded_replica: bool = False) -> dict[str, int | None] | None:
    """The shard columns: a shard's engine's shard, none for a sharded replica's own row; None unsharded."""
    if config.shards <= 1:
        return None
    return {"shard": None if sharded_replica else config.shard, "shards": config.shards}


def row_values(identity: dict[str, object], snapshot: StatusSnapshot) -> dict[str, object]:
    """A status row's values (ROW_COLUMNS but last_seen): `identity`'s, reporting `snapshot`."""
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


def status_table_exists(conn: psycopg.Connection, table: str) -> bool:
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL", [table_name(table)]).fetchone()[0]


class HistorySampler:
    """One engine's history samples, on the status writer's session; a leader's carries the server's time per kind
    of statement from pg_stat_statements (`statements`: the last read, None where none was)."""

    def __init__(self, config: HarvestConfig, identity: dict[str, object], writer_statements: list[str]) -> None:
        self._identity = identity
        self._harvested = table_name(config.table)
        self._history_table = f"{config.status_table}_history"  # beside the status table
        self._history_interval = config.limits.history_interval
        self._history_retention = config.history_retention
        history = table_identifier(self._history_table)
        harvested = table_identifier(config.table)
        self._sample, self._sample_costs = (sql.SQL(SAMPLE).format(
            table=harvested, history=history, cost_columns=sql.SQL(columns), cost_values=sql.SQL(values))
            for columns, values in (("", ""), (COST_COLUMNS, COST_VALUES)))
        self._prune_history = sql.SQL(PRUNE_HISTORY).format(history=history)
        self._history_on: bool | None = None
        self._history_costs = False
        self._history_outage = SaidOnce(log, "History sample not written (harvesting goes on): %s")
        # Its own statements, the status writer's and the dead letters' retention count as `status`.
        own = [statement.as_string() for statement in (self._sample, self._sample_costs, self._prune_history)]
        if config.dead_letter_table:
            own.append(sql.SQL(retention.PRUNE).format(table=table_identifier(config.dead_letter_table)).as_string())
        statements = {**dbtime.engine_statements(config.table, config.dead_letter_table, config.shards),
                      **{text: "status" for text in [*own, *writer_statements]}}
        self._server_time = dbtime.ServerTime(dbtime.StatementKinds(statements), dbtime.server_patterns(
            [config.table, config.status_table, self._history_table,
             *([config.dead_letter_table] if config.dead_letter_table else [])]))
        self._statements_on: bool | None = None
        self.statements: dbtime.Totals | None = None
        self._next_sample = 0.0

    def sample(self, conn: psycopg.Connection, snapshot: StatusSnapshot) -> None:
        """A sample when due, and those older than history_retention deleted. Raises psycopg.Error only when the
        session broke (the writer reconnects)."""
        if self._history_on is False or time.monotonic() < self._next_sample:
            return
        if self._history_on is None:
            self._history_on = status_table_exists(conn, self._history_table)
            if not self._history_on:
                log.info("History off: table %s does not exist (%s)", self._history_table,
                         how_made(self._history_table, f"{STATUS_TABLE}_history"))
                return
            self._history_costs = conn.execute(HAS_COLUMNS, {"table": table_name(self._history_table),
                                                             "first": "db_round_trips", "second": "db_statements"}
                                               ).fetchone()[0]
        self._next_sample = time.monotonic() + self._history_interval
        params = row_values(self._identity, snapshot)
        leads = snapshot.state is ReplicaState.LEADER
        if not leads:
            self._server_time.again()  # a new term may run statements the last did not: learn them soon again
        self.statements = statements = self._read_statements(conn) if leads else None
        costs = {"db_round_trips": Jsonb(dbtime.as_json(snapshot.round_trips)),
                 "db_statements": None if statements is None else Jsonb(dbtime.as_json(statements))}
        try:
            with conn.transaction():
                conn.execute(self._sample_costs if self._history_costs else self._sample,
                             {**params, **costs, "held": len(snapshot.held), "count_limit": HISTORY_COUNT_LIMIT,
                              "table_name": self._harvested})
                conn.execute(self._prune_history, {"age": self._history_retention})
        except psycopg.Error as error:
            if conn.broken:
                raise
            self._history_outage.failed(first_line(error))
            return
        self._history_outage.ended()

    def _read_statements(self, conn: psycopg.Connection) -> dbtime.Totals | None:
        """The server's time per statement kind; None where pg_stat_statements cannot be read (said once)."""
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
                raise
            why = first_line(error)
        log.info("The database's time per statement is not recorded (the round trips are): pg_stat_statements: %s",
                 why)
        self._statements_on = False
        return None


class StandbyNotes:
    """What a replica of one outbox says once, from the status rows: who leads its group while it stands by, and a
    replica of its group harvesting another table."""

    def __init__(self, config: HarvestConfig, identity: dict[str, object]) -> None:
        ident = table_identifier(config.status_table)
        self._leaders, self._other_tables = (sql.SQL(text).format(table=ident) for text in (LEADERS, OTHER_TABLES))
        self._identity = identity
        self._group = config.leader_group
        self._gone_after = max(4 * config.limits.status_interval, 10.0)
        #: Who leads is said by a replica's own row, not by each shard's engine.
        self._who_leads = config.shards <= 1
        self._shared_said: set[str] = set()
        self._standby_said: object = None  # the `since` of the standby spell already announced

    def say(self, conn: psycopg.Connection, snapshot: StatusSnapshot) -> None:
        if self._who_leads and snapshot.state is ReplicaState.STANDBY and self._standby_said != snapshot.since:
            self._say_who_leads(conn, snapshot)
        self._say_if_group_shared(conn)

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
