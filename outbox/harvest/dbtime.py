"""What harvesting costs the database, by kind of statement: what an operator needs to see what the
outbox costs the primary.

Two measures, each where it can be taken:

- **Round trips** (always): the driver times every database job it runs (driver.py) on the client:
  the time the harvester's session waited for the answer, per kind of job. A mark is one round trip
  that carries the mark, the outbox's writers and the gap lookups together (pipelined), so they are
  one kind here.
- **Server time** (where the database has pg_stat_statements): the execution time, calls and rows
  Postgres counted for each of the harvester's statements, read by the leader's status reporter and
  told apart by their text (writers and gaps as kinds of their own). It counts every replica that
  harvested this table since the statistics were last reset, and includes the status reporter's own
  statements (kind `status`).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import psycopg
from psycopg import sql

from outbox.harvest import contract

#: Kinds of statement, in the order they are shown. Round trips have all of them but gaps and
#: writers (sent in the mark's round trip) and status (not the driver's).
KINDS = ("mark", "gaps", "writers", "purge", "reset", "hold", "check_held", "park", "fence", "partitions", "status")
#: `partitions`: a pass of the partition keeper (a partitioned outbox only; partitions.py), timed as a whole.
ROUND_TRIP_KINDS = ("mark", "purge", "reset", "hold", "check_held", "park", "fence", "partitions")
#: Kinds told apart in pg_stat_statements (the partition keeper's DDL names each partition: not among them).
SERVER_KINDS = tuple(kind for kind in KINDS if kind != "partitions")
#: What each kind is, for people.
LABELS = {"mark": "mark", "gaps": "gaps", "writers": "writers", "purge": "purge", "reset": "reset", "hold": "hold",
          "check_held": "check held", "park": "park", "fence": "fence", "partitions": "partition upkeep",
          "status": "status"}

#: Per kind: (statements or round trips, seconds, rows).
Totals = dict[str, tuple[int, float, int]]


class RoundTrips:
    """Each kind's round trips, seconds waited and rows answered, since the harvester started.

    Added to by the fence and purge sessions' threads, read by the status thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, list[float]] = {}

    def add(self, kind: str, seconds: float, rows: int) -> None:
        with self._lock:
            total = self._totals.get(kind)
            if total is None:
                self._totals[kind] = [1, seconds, rows]
            else:
                total[0] += 1
                total[1] += seconds
                total[2] += rows

    def totals(self) -> Totals:
        with self._lock:
            return {kind: (int(n), float(s), int(r)) for kind, (n, s, r) in self._totals.items()}


# -- server time (pg_stat_statements) ---------------------------------------------------------------

#: What pg_stat_statements may write for a value the client sent or a constant in the text (booleans
#: included), and what the engine's text has for a parameter: all alike once normalized.
_VALUES = re.compile(r"%\(\w+\)s|\$\d+|'(?:[^']|'')*'|(?<![\w.])\d+(?:\.\d+)?(?![\w.])|\b(?:true|false)\b",
                     re.IGNORECASE)
_SPACE = re.compile(r"\s+")


def normalize(text: str) -> str:
    """A statement's text with every parameter and constant as `?` and runs of white space as one space:
    the engine's text and the one pg_stat_statements keeps of it compare equal."""
    return _SPACE.sub(" ", _VALUES.sub("?", text)).strip().rstrip(";").strip().lower()


def engine_statements(table: str, dead_letter_table: str | None = None, shards: int = 1) -> dict[str, str]:
    """The engine's statements on `table` (contract.py) as the store sends them, by kind."""
    ident = sql.Identifier(*table.split("."))
    above = sql.SQL(contract.mark_above(shards))
    texts = {
        contract.MARK: "mark", (contract.GAPS if shards <= 1 else contract.shard_gaps(shards)): "gaps",
        contract.WRITERS: "writers", contract.PURGE: "purge", contract.PURGE_UNFENCED: "purge",
        contract.RESET: "reset", contract.RESET_COUNTED: "reset", contract.HOLD: "hold",
        contract.HOLD_COUNTED: "hold", contract.CHECK_HELD: "check_held", contract.TAKE_FENCE: "fence",
        contract.RELEASE_FENCE: "fence", contract.FENCE_HOLDER: "fence", contract.TERMINATE: "fence",
        contract.TAKE_SHARED_FENCE: "fence", contract.RELEASE_SHARED_FENCE: "fence",
        contract.OTHER_SHARD_COUNT: "fence",
    }
    found = {sql.SQL(text).format(table=ident, above=above).as_string(): kind for text, kind in texts.items()}
    if dead_letter_table:
        park = sql.SQL(contract.PARK).format(table=ident, dead_letters=sql.Identifier(*dead_letter_table.split(".")))
        found[park.as_string()] = "park"
    return found


class StatementKinds:
    """Tells the harvester's statements among pg_stat_statements' rows by their normalized text (and,
    once a query id was told, by the id)."""

    def __init__(self, statements: Mapping[str, str]) -> None:
        self._by_text = {normalize(text): kind for text, kind in statements.items()}
        self._by_id: dict[int, str | None] = {}

    def kind(self, query_id: int, text: str) -> str | None:
        if query_id not in self._by_id:
            self._by_id[query_id] = STATUS if TAG in text else self._by_text.get(normalize(text))
        return self._by_id[query_id]

    def known(self, query_id: int) -> str | None:
        """The kind of a query id told before (None: not the harvester's, or not seen yet)."""
        return self._by_id.get(query_id)

    def ours(self) -> list[int]:
        return [query_id for query_id, kind in self._by_id.items() if kind is not None]


#: The reads below are the status reporter's: tagged, so that they count as `status` too.
TAG = "outbox-harvest status"
STATUS = "status"
# The rows of pg_stat_statements in this database that may be the harvester's, with their texts: those
# naming one of its tables or a catalogue view its statements read (the filter keeps them few; the kinds
# are told in Python). Reading the texts is what costs (the server reads them from a file), so it is
# done now and then: in between, the rows already told are read by query id, without their texts.
LEARN = f"""
SELECT /* {TAG} */ queryid, query, calls, total_exec_time, rows FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND query LIKE ANY(%(patterns)s)
"""
READ = f"""
SELECT /* {TAG} */ queryid, calls, total_exec_time, rows FROM pg_stat_statements(false)
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) AND queryid = ANY(%(ids)s)
"""
CATALOGUE_PATTERNS = ("%pg_locks%", "%advisory%", "%pg_terminate_backend%", "%pg_stat_user_tables%", f"%{TAG}%")
#: Seconds between reads of the texts, at most (statements the harvester had not run at the last one, a first
#: park or reset, are counted from the next).
LEARN_INTERVAL = 600.0
#: The second read of the texts comes this long after the first, and each later one twice as long after the one
#: before, up to LEARN_INTERVAL: what a new leader first runs soon after it starts (its first gap's lookup and the
#: outbox's writers read with it, a first reset) is counted within seconds, not ten minutes later.
FIRST_RELEARN = 10.0


def server_patterns(tables: Iterable[str]) -> list[str]:
    """LIKE patterns that keep the rows naming one of `tables` (quoted, as the engine names them)."""
    quoted = ["%" + ".".join('"' + part.replace('"', '""') + '"' for part in table.split(".")) + "%"
              for table in tables]
    return [pattern.replace("\\", "\\\\") for pattern in quoted] + list(CATALOGUE_PATTERNS)


class ServerTime:
    """Reads each kind's calls, execution seconds and rows as pg_stat_statements counts them, on the
    caller's connection. A read raises psycopg.Error when the view cannot be read (not installed in this
    database, or the module not loaded)."""

    def __init__(self, kinds: StatementKinds, patterns: list[str], learn_interval: float = LEARN_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kinds = kinds
        self._patterns = patterns
        self._learn_interval = learn_interval
        self._clock = clock
        self._learn_at: float | None = None
        self._relearn_after = min(FIRST_RELEARN, learn_interval)

    def again(self) -> None:
        """Start the schedule again (a replica that stopped leading): the next read learns the texts, then 10 s on."""
        self._learn_at = None
        self._relearn_after = min(FIRST_RELEARN, self._learn_interval)

    def read(self, conn: psycopg.Connection) -> Totals:
        rows: list[tuple[int, int, float, int]]
        if self._learn_at is None or self._clock() >= self._learn_at:
            found = conn.execute(LEARN, {"patterns": self._patterns}).fetchall()
            rows = [(query_id, calls, ms, count) for query_id, text, calls, ms, count in found
                    if self.kinds.kind(query_id, text) is not None]
            self._learn_at = self._clock() + self._relearn_after
            self._relearn_after = min(2 * self._relearn_after, self._learn_interval)
        else:
            rows = conn.execute(READ, {"ids": self.kinds.ours()}).fetchall()
        totals: dict[str, list[float]] = {}
        for query_id, calls, milliseconds, count in rows:
            total = totals.setdefault(self.kinds.known(query_id), [0, 0.0, 0])
            total[0] += calls
            total[1] += milliseconds / 1000
            total[2] += count
        return {kind: (int(n), float(s), int(r)) for kind, (n, s, r) in totals.items()}


def as_json(totals: Totals) -> dict[str, list[float]]:
    """Totals as a history sample keeps them: kind -> [count, seconds, rows]."""
    return {kind: [n, round(s, 6), r] for kind, (n, s, r) in totals.items()}
