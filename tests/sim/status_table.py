"""The harvesters' status table (outbox_harvester) as the world keeps it, and the health probe's verdict on it.

The rows are what the production code makes of each engine's state (status.identity, status.snapshot_of,
status.row_values, status.shard_columns), written every REPORT_EVERY of a process's running time, as the
process's status writer (status_board.py) writes each engine's, and deleted when the engine stops (a shard's
engine leaves no row). A process that crashed or pauses writes nothing: its rows age, and count as gone after
GONE_AFTER, as in the status table. The verdict is `manage.py harvest_health --any`'s (replicas.health on
replicas.Replicas).

Checked: every shard the verdict says a replica leads is one whose row that replica's engine wrote as leader,
and no shard the rows say it leads is left out or credited to another.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

from outbox.harvest import replicas, status
from outbox.harvest.replicas import LATER_COLUMNS, Replicas
from outbox.kafka.memory.world import SimWorld, Violation

#: A process's status thread writes its engines' rows this often.
REPORT_EVERY = 1.0
#: A row not written for this long is gone (OUTBOX["status_gone_after"]'s default).
GONE_AFTER = replicas.GONE_AFTER
#: The simulated clock's second 0.
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
#: "r1 leads shard(s) 0, 2 of 3" in a verdict.
CLAIM = re.compile(r"(\S+) leads shard\(s\) ([\d, ]+) of \d+")


class StatusTable:
    """The rows by name, each with the process that wrote it (`writer`) and when (`last_seen`)."""

    def __init__(self, world: SimWorld) -> None:
        self.world = world
        self.rows: dict[str, Any] = {}

    def now(self) -> datetime:
        return EPOCH + timedelta(seconds=self.world.now)

    def write(self, writer: str, config: Any, snapshot: status.StatusSnapshot) -> None:
        """The process's status writer upserts the engine's row, with its shard (status_board.UPSERT_MANY_SHARDS)."""
        values = status.row_values(status.identity(config, EPOCH, host="sim", pid=0), snapshot)
        columns = status.shard_columns(config) or {}
        self.rows[config.name] = SimpleNamespace(**{**LATER_COLUMNS, **values, **columns}, last_seen=self.now(),
                                                 writer=writer)

    def forget(self, name: str) -> None:
        """A shard's engine stopped: its row goes (FORGET)."""
        self.rows.pop(name, None)

    def check_verdict(self) -> None:
        """The probe's verdict credits each replica with exactly the shards its own engines' rows say it leads."""
        now = self.now()
        found = Replicas.sort(self.rows.values(), now, GONE_AFTER)
        healthy, verdict = replicas.health(found, now, any=True)
        if not healthy:
            return
        claimed: dict[str, set[int]] = {}
        for replica, shards in CLAIM.findall(verdict):
            claimed.setdefault(replica, set()).update(int(shard) for shard in shards.split(", "))
        written: dict[str, set[int]] = {}
        for row in found.leaders:
            if row.shard is not None:
                written.setdefault(row.writer, set()).add(row.shard)
        if claimed != written:
            raise Violation(f"the health probe says {verdict!r}; the rows say {sorted(written.items())}")
