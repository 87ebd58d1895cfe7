"""Changing how many shards a group harvests its outbox in: what `manage.py outbox_reshard` and
`outbox-harvest reshard` both do, with the group's replicas stopped.

    reshard(config, 6)   # "'outbox' is now harvested in 6 shard(s): leader topic ... grown from 4 to 6 ..."

A key's shard depends on N, so a key's records must never be published by an old-N leader and a new-N
leader at once. The fences see to that whatever the order (sharding.py: a leader lets its N's lock go
only once nothing it sent is in flight, and no leader of another N can lead meanwhile); this makes the
change itself explicit: it refuses while any leader of the table holds a fence, gives the leader topic
one partition per new shard, and builds the new N's index (dropping the old ones). Nothing in the table
changes: marks are reads, so no row is "marked under the old N". Nothing here imports Django.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import psycopg
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic
from psycopg import sql

from outbox.harvest import contract, sharding
from outbox.harvest.config import HarvestConfig
from outbox.harvest.kafka import cluster_metadata
from outbox.harvest.shard_index import ensure_shard_index, session
from outbox.harvest.store import MIGRATE_HINT, StoreError, describe_dsn, table_identifier, table_name
from outbox.kafka.clients import KAFKA_START_TIMEOUT, KafkaUnavailable, admin_config
from outbox.reasons import first_line, kafka_reason

#: Every advisory-lock class a leader of the table may hold: the unsharded fence, any shard's, any N's.
FENCES_HELD = """
SELECT DISTINCT a.application_name, a.pid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.objid = %(oid)s AND l.objsubid = 1 AND l.granted
  AND (l.classid::bigint = %(unsharded)s OR l.classid::bigint BETWEEN %(lo)s AND %(hi)s)
"""
OLD_INDEXES = """
SELECT n.nspname, c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE i.indrelid = to_regclass(%(table)s) AND c.relname ~ %(pattern)s AND c.relname <> %(keep)s
"""


class ReshardRefused(Exception):
    """The change cannot be made now (a leader still runs, the table or a broker is not there): one line."""


def reshard(config: HarvestConfig, shards: int) -> str:
    """Give `config`'s group `shards` shards (its leader topic, the table's index); what was done, in one line.
    ReshardRefused (one line) when it cannot be done, before anything changed where it can tell."""
    if (problem := sharding.shards_problem(shards)) is not None:
        raise ReshardRefused(f"--shards: {problem}")
    try:
        conn = session(config.dsn)
    except StoreError as error:
        raise ReshardRefused(str(error)) from None
    with conn:
        try:
            oid = conn.execute(contract.TABLE_OID, {"table": table_name(config.table)}).fetchone()[0]
            if oid is None:
                raise ReshardRefused(f"table {config.table!r} does not exist ({MIGRATE_HINT})")
            held = conn.execute(FENCES_HELD, {"oid": oid, "unsharded": contract.FENCE_CLASS,
                                              "lo": sharding.SHARD_CLASS_BASE,
                                              "hi": sharding.SHARD_COUNT_CLASS_BASE + sharding.MAX_SHARDS}).fetchall()
        except psycopg.Error as error:
            raise ReshardRefused(f"cannot read {config.table!r} at {describe_dsn(config.dsn)}: "
                                 f"{first_line(error)}") from None
        if held:
            who = ", ".join(f"{application} (pid {pid})" for application, pid in held)
            raise ReshardRefused(f"a harvester leads on {config.table!r} ({who}): stop every replica of the group "
                                 f"first, then run this again")
        partitions = _leader_topic(config.base_kafka_config, config.leader_topic, shards)
        dropped = _drop_other_indexes(conn, config.table, shards)
    if shards > 1:
        try:
            ensure_shard_index(config.dsn, config.table, shards)
        except StoreError as error:
            raise ReshardRefused(str(error)) from None
    index = f"index {sharding.index_name(config.table, shards)} ready" if shards > 1 else "no shard index needed"
    return (f"{config.table!r} is now harvested in {shards} shard(s): leader topic {config.leader_topic!r} "
            f"{partitions}; {index}" + (f"; dropped {', '.join(dropped)}" if dropped else "") + ".")


def _leader_topic(base: Mapping[str, Any], topic: str, shards: int) -> str:
    """One partition per shard: added to the topic, or the topic made again (it holds only heartbeats)."""
    base = dict(base)
    try:
        found = cluster_metadata(base, KAFKA_START_TIMEOUT).topics.get(topic)
    except KafkaUnavailable as error:
        raise ReshardRefused(str(error)) from None
    admin = AdminClient(admin_config(base))
    exists = found is not None and found.error is None
    try:
        if exists and len(found.partitions) == shards:
            return f"has {shards} partition(s) already"
        if exists and len(found.partitions) < shards:
            admin.create_partitions([NewPartitions(topic, shards)])[topic].result(KAFKA_START_TIMEOUT)
            return f"grown from {len(found.partitions)} to {shards} partition(s)"
        if exists:
            admin.delete_topics([topic])[topic].result(KAFKA_START_TIMEOUT)
            _wait_gone(base, topic)
        admin.create_topics([NewTopic(topic, num_partitions=shards)])[topic].result(KAFKA_START_TIMEOUT)
    except KafkaException as error:
        raise ReshardRefused(f"cannot give leader topic {topic!r} {shards} partition(s): "
                             f"{kafka_reason(error)}") from None
    return f"made again with {shards} partition(s)" if found is not None else f"created with {shards} partition(s)"


def _wait_gone(base: dict[str, Any], topic: str) -> None:
    deadline = time.monotonic() + KAFKA_START_TIMEOUT
    try:
        while topic in cluster_metadata(base, KAFKA_START_TIMEOUT).topics:
            if time.monotonic() > deadline:
                raise ReshardRefused(f"leader topic {topic!r} is still being deleted; run this again in a moment")
            time.sleep(0.2)
    except KafkaUnavailable as error:
        raise ReshardRefused(str(error)) from None


def _drop_other_indexes(conn: psycopg.Connection, table: str, shards: int) -> list[str]:
    """Drop the indexes of other numbers of shards: nothing reads them any more, every write pays for them."""
    base = table.rsplit(".", 1)[-1][:40]
    keep = sharding.index_name(table, shards) if shards > 1 else ""
    try:
        found = conn.execute(OLD_INDEXES, {"table": table_name(table), "pattern": f"^{base}_shard[0-9]+_idx$",
                                           "keep": keep}).fetchall()
    except psycopg.Error as error:
        raise ReshardRefused(f"cannot list the shard indexes of {table!r}: {first_line(error)}") from None
    for schema, name in found:
        try:
            conn.execute(sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(table_identifier(f"{schema}.{name}")))
        except psycopg.Error as error:
            raise ReshardRefused(f"cannot drop index {name}: {first_line(error)}") from None
    return [name for _, name in found]
