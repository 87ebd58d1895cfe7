"""Retention of parked records: the dead-letter table is kept for operators, not forever. The leading
replica deletes rows parked longer than `dead_letter_retention` ago, a bounded batch at a time so a
first pass over a big table never holds locks for long; the status reporter's thread runs it."""

from __future__ import annotations

import logging
import time

import psycopg
from psycopg import sql

from outbox.harvest.config import HarvestConfig
from outbox.harvest.store import table_identifier, table_name
from outbox.reasons import first_line

log = logging.getLogger("outbox.harvest")

#: How often the leader looks for expired dead letters (seconds), and how many it deletes a pass.
PASS_INTERVAL = 60.0
BATCH = 10_000
PRUNE = """
DELETE FROM {table} WHERE id IN (
    SELECT id FROM {table} WHERE parked_at < now() - make_interval(secs => %(age)s) ORDER BY id LIMIT %(batch)s)
"""


class DeadLetterRetention:
    """One pass every PASS_INTERVAL while leading; a missing table (parking off) is asked about once."""

    def __init__(self, config: HarvestConfig, *, pass_interval: float = PASS_INTERVAL) -> None:
        self._table = config.dead_letter_table
        self._pass_interval = pass_interval
        self._age = config.dead_letter_retention
        self._on: bool | None = None if self._table and self._age is not None else False
        self._prune = sql.SQL(PRUNE).format(table=table_identifier(self._table or "unused"))
        self._next = 0.0
        self._failing = False
        #: Rows deleted since the start (the tests and the soak read it).
        self.deleted = 0

    def run(self, conn: psycopg.Connection, leading: bool) -> int:
        """Delete a batch of expired dead letters if it is time and this replica leads; returns how many."""
        if self._on is False or not leading or time.monotonic() < self._next:
            return 0
        self._next = time.monotonic() + self._pass_interval
        try:
            if self._on is None:
                row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table_name(self._table or ""),)).fetchone()
                self._on = bool(row and row[0])
                if not self._on:
                    return 0
            with conn.transaction():
                deleted = conn.execute(self._prune, {"age": self._age, "batch": BATCH}).rowcount
        except psycopg.Error as error:
            if conn.broken:
                raise
            if not self._failing:  # say it once, not every pass
                log.warning("Expired dead letters not deleted (harvesting goes on): %s", first_line(error))
            self._failing = True
            return 0
        self._failing = False
        if deleted:
            self.deleted += deleted
            log.info("Deleted %d dead letter(s) parked over %gs ago (dead_letter_retention)", deleted, self._age)
        if deleted >= BATCH:
            self._next = 0.0  # more to do: the next report goes on
        return deleted
