"""Tenant schemas for the many-outboxes tests, as django-tenants' migrations leave them: the outbox table
(an identity of its own: ids repeat across tenants) and its NOTIFY trigger."""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator

import psycopg
import pytest
from confluent_kafka import Consumer, KafkaError, TopicPartition
from psycopg import sql

from tests.support.harness import Audit

#: Every schema the tests make starts with this; the fixture drops them all, before and after.
PREFIX = "mt_"


def create_tenant(conn: psycopg.Connection, schema: str) -> None:
    ident = sql.Identifier(schema)
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(ident))
    conn.execute(sql.SQL("CREATE TABLE {}.outbox (LIKE public.outbox INCLUDING ALL)").format(ident))
    conn.execute(sql.SQL("CREATE TRIGGER outbox_notify AFTER INSERT ON {}.outbox FOR EACH STATEMENT "
                         "EXECUTE FUNCTION public.outbox_notify()").format(ident))


@pytest.fixture
def tenants(database_url: str) -> Iterator[psycopg.Connection]:
    """A connection to make tenant schemas with; every `mt_` schema is dropped before and after."""
    def drop_all(conn: psycopg.Connection) -> None:
        for (schema,) in conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'mt\\_%'").fetchall():
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))

    with psycopg.connect(database_url, autocommit=True) as conn:
        drop_all(conn)
        try:
            yield conn
        finally:
            drop_all(conn)


class TenantWriter(threading.Thread):
    """Writes `count` records to each schema's outbox, a few per transaction, keys round-robin (named after
    the schema, so a key lives in one outbox): per key, commit order is id order. `topics` maps each schema
    to the topic its records name."""

    def __init__(self, database_url: str, topics: dict[str, str], count: int, keys: int = 7) -> None:
        super().__init__(daemon=True)
        self.database_url, self.topics, self.count, self.keys = database_url, topics, count, keys
        self.ids: dict[str, list[int]] = {schema: [] for schema in topics}
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.database_url, autocommit=True) as conn:
                for sequence in range(0, self.count, 5):
                    for schema, topic in self.topics.items():
                        with conn.transaction():
                            rows = conn.execute(
                                sql.SQL("INSERT INTO {}.outbox (kafka_topic, kafka_key, kafka_value) "
                                        "SELECT %s, %s || '-key-' || (n %% %s::int), 'value-' || n "
                                        "FROM generate_series(%s::int, %s::int) n RETURNING id"
                                        ).format(sql.Identifier(schema)),
                                [topic, schema, self.keys, sequence, min(sequence + 5, self.count) - 1]).fetchall()
                        self.ids[schema].extend(row[0] for row in rows)
                    time.sleep(0.002)
        except BaseException as error:
            self.failure = error


def read_tenants(bootstrap: str, topic: str, written: dict[str, list[int]], timeout: float = 120) -> dict[str, Audit]:
    """Read `topic` (every tenant's records, TenantWriter's keys) from the beginning into an Audit per schema,
    until each schema's ids written have arrived or `timeout` passes: ids repeat across tenants, so a record
    is its schema (its key's prefix) and its id."""
    audits: dict[str, Audit] = defaultdict(Audit)
    missing = {schema: set(ids) for schema, ids in written.items()}
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"audit-{uuid.uuid4().hex}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    try:
        partitions = list(consumer.list_topics(topic, timeout=30).topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        deadline = time.monotonic() + timeout
        while any(missing.values()) and time.monotonic() < deadline:
            for message in consumer.consume(1000, timeout=1.0):
                if message.error():
                    if message.error().code() != KafkaError._PARTITION_EOF:
                        raise AssertionError(f"consumer error: {message.error()}")
                    continue
                key = message.key().decode()
                schema = key.split("-key-")[0]
                record_id = int(dict(message.headers())["outbox-id"])
                audits[schema].by_key[key].append(record_id)
                audits[schema].messages += 1
                missing.get(schema, set()).discard(record_id)
    finally:
        consumer.close()
    return audits
