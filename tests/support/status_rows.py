"""Status rows of replicas that are not running, written exactly as a running one writes its own.

The row goes through the status writer's own upsert (outbox.harvest.status_board) with the values a running
engine's row has (status.row_values), so a test's row says only what a real replica can say:
a leader id only while it leads, `blocked_by` only while it is blocked, held records as the
engine's HeldRecord.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from django.db import connections
from psycopg import sql
from psycopg.types.json import Jsonb

from outbox.harvest.contract import HeldRecord, ReplicaState
from outbox.harvest.status_board import UPSERT_MANY_SHARDS, board_row
from outbox.models import HarvesterStatus


def held_record(record_id: int, key: str, *, topic: str = "orders", reason: str = "Broker: Message size too large",
                attempts: int = 1, held_for: float = 90.0, behind: int = 0, more_behind: bool = False) -> HeldRecord:
    return HeldRecord(record_id, key, topic, reason, attempts, held_for, behind, more_behind)


def status_row(name: str, state: ReplicaState = ReplicaState.STANDBY, *, leader_id: uuid.UUID | None = None,
               marked_upto: int | None = None, group: str = "g", host: str = "host-a", seen: float = 0.0,
               held: Sequence[HeldRecord] = (),
               in_flight_keys: Sequence[str] = (), queued: int = 0, blocked_by: str | None = None,
               throughput: float = 0.0, published: int = 0, using: str = "default",
               shard: int | None = None, shards: int = 1, table: str = "outbox") -> HarvesterStatus:
    """Upsert a replica's status row; `seen` seconds ago. With `shards`, a shard engine's row (`shard`), or the
    sharded replica's own (no shard), as the status writer writes them."""
    if leader_id is not None and state is not ReplicaState.LEADER:
        raise ValueError("only a leader reports a leader id")
    if marked_upto is not None and leader_id is None:
        raise ValueError("only a term (a leader id) has read rows")
    if (blocked_by is not None) != (state is ReplicaState.BLOCKED):
        raise ValueError("a replica reports blocked_by exactly while it is blocked")
    if held and state is not ReplicaState.LEADER:
        raise ValueError("only a leader holds records")
    now = datetime.now(UTC)
    params = {
        "name": name, "host": host, "pid": 1234, "started": now - timedelta(hours=1), "harvested_table": table,
        "leader_topic": group, "leader_group": group, "state": str(state), "leader_id": leader_id,
        "marked_upto": marked_upto, "since": now - timedelta(minutes=5), "in_flight": len(in_flight_keys),
        "queued": queued,
        "in_flight_keys": list(in_flight_keys), "in_flight_key_count": len(in_flight_keys),
        "held_keys": [f"{h.key}: {h.reason}" for h in held], "held": json.dumps([h.as_json() for h in held]),
        "blocked_by": blocked_by, "throughput": throughput, "published": published, "failed": 0,
    }
    connection = connections[using]
    connection.ensure_connection()
    columns = {"shard": shard, "shards": shards} if shards > 1 else None
    with connection.connection.cursor() as cursor:
        cursor.execute(sql.SQL(UPSERT_MANY_SHARDS).format(table=sql.Identifier(HarvesterStatus._meta.db_table)),
                       {"rows": Jsonb([board_row(params, columns)])})
    if seen:
        HarvesterStatus.objects.using(using).filter(name=name).update(last_seen=now - timedelta(seconds=seen))
    return HarvesterStatus.objects.using(using).get(name=name)
