"""Tenant schemas for the many-outboxes tests, as django-tenants' migrations leave them: the outbox table
(its ids from public's sequence, so an id names one record across tenants) and its NOTIFY trigger."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

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

    @property
    def all_ids(self) -> list[int]:
        return sorted(i for ids in self.ids.values() for i in ids)

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
