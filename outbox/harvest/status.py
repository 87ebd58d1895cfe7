"""Each replica's status row: who it is, whether it leads, what it has in flight.

The row is upserted every `status_interval` seconds on a connection of its own, so writing it
never waits on harvesting (or the reverse); the admin dashboard and `harvest_health` read it.
Rows not seen for `status_prune_after` seconds are deleted by whichever replica notices.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime

import psycopg
from psycopg import sql

from outbox.harvest.store import close_quietly, connect, first_line, table_identifier, table_name

log = logging.getLogger(__name__)

#: Keys listed in a status row; the total count is kept beside the sample.
KEY_SAMPLE = 50


@dataclass(frozen=True)
class StatusSnapshot:
    """What a replica reports about itself at one moment."""

    state: str  # standby, leader, fenced, stopping
    leader_id: object
    since: datetime
    in_flight: int
    in_flight_keys: list[str]
    in_flight_key_count: int
    held_keys: list[str]
    throughput: float
    published: int
    failed: int


UPSERT = """
INSERT INTO {table} (name, host, pid, state, leader_id, since, started, last_seen, harvested_table, leader_topic,
                     leader_group, in_flight, in_flight_keys, in_flight_key_count, held_keys, throughput, published,
                     failed)
VALUES (%(name)s, %(host)s, %(pid)s, %(state)s, %(leader_id)s, %(since)s, %(started)s, now(), %(harvested_table)s,
        %(leader_topic)s, %(leader_group)s, %(in_flight)s, %(in_flight_keys)s, %(in_flight_key_count)s,
        %(held_keys)s, %(throughput)s, %(published)s, %(failed)s)
ON CONFLICT (name) DO UPDATE SET
  host = EXCLUDED.host, pid = EXCLUDED.pid, state = EXCLUDED.state, leader_id = EXCLUDED.leader_id,
  since = EXCLUDED.since, last_seen = now(), harvested_table = EXCLUDED.harvested_table,
  leader_topic = EXCLUDED.leader_topic, leader_group = EXCLUDED.leader_group, in_flight = EXCLUDED.in_flight,
  in_flight_keys = EXCLUDED.in_flight_keys, in_flight_key_count = EXCLUDED.in_flight_key_count,
  held_keys = EXCLUDED.held_keys, throughput = EXCLUDED.throughput, published = EXCLUDED.published,
  failed = EXCLUDED.failed
"""
PRUNE = "DELETE FROM {table} WHERE last_seen < now() - make_interval(secs => %(age)s)"
REMOVE = "DELETE FROM {table} WHERE name = %(name)s"
# A live-row estimate for the harvested table, kept by Postgres's statistics: no table scan.
BACKLOG = "SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = to_regclass(%(table)s)"


def status_table_exists(conn: psycopg.Connection, table: str) -> bool:
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL", [table_name(table)]).fetchone()[0]


class StatusReporter(threading.Thread):
    """Upserts this replica's status row every `interval` seconds until stopped, then deletes it."""

    def __init__(self, dsn: str, status_table: str, *, name: str, harvested_table: str, leader_topic: str,
                 leader_group: str, started: datetime, interval: float, prune_after: float,
                 snapshot: Callable[[], StatusSnapshot], on_backlog: Callable[[int], None]) -> None:
        super().__init__(name="outbox-status", daemon=True)
        self._dsn = dsn
        ident = table_identifier(status_table)
        self._upsert = sql.SQL(UPSERT).format(table=ident)
        self._prune = sql.SQL(PRUNE).format(table=ident)
        self._remove = sql.SQL(REMOVE).format(table=ident)
        self._identity = {"name": name, "host": socket.gethostname(), "pid": os.getpid(), "started": started,
                          "harvested_table": harvested_table, "leader_topic": leader_topic,
                          "leader_group": leader_group}
        self._harvested = table_name(harvested_table)
        self._interval = interval
        self._prune_after = prune_after
        self._snapshot = snapshot
        self._on_backlog = on_backlog
        self._stop_event = threading.Event()
        self._conn: psycopg.Connection | None = None
        self._failing = False

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        while True:
            self._report()
            if self._stop_event.wait(self._interval):
                break
        try:
            self._connection().execute(self._remove, {"name": self._identity["name"]})
        except psycopg.Error as error:
            log.debug("Could not remove the status row: %s", first_line(error))
        self._close()

    def _report(self) -> None:
        snapshot = self._snapshot()
        params = {**self._identity, **asdict(snapshot)}
        try:
            conn = self._connection()
            with conn.transaction():
                conn.execute(self._upsert, params)
                conn.execute(self._prune, {"age": self._prune_after})
            row = conn.execute(BACKLOG, {"table": self._harvested}).fetchone()
            if row is not None:
                self._on_backlog(int(row[0]))
            if self._failing:
                log.info("Status reporting resumed")
            self._failing = False
        except psycopg.Error as error:
            if not self._failing:  # say it once, not every interval
                log.warning("Status row not written (harvesting goes on): %s", first_line(error))
            self._failing = True
            self._close()

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self._dsn, "status")
        return self._conn

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        close_quietly(conn)
