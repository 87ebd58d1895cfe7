"""LISTEN/NOTIFY wake-ups, polling for plain-SQL rows, and harvesting a table no Django model owns."""

from __future__ import annotations

import time
import uuid

import psycopg
import pytest
from django.db import transaction

from outbox import stash
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.harvester import Harvester
from tests.integration.harness import outbox_count, read_topic, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def start_harvester(database_url: str, bootstrap: str, *, table: str = "outbox", listen: bool = True,
                    mark_backoff: float) -> Harvester:
    leader = f"test-leader-{uuid.uuid4().hex[:8]}"
    harvester = Harvester(HarvestConfig(
        dsn=database_url, table=table, base_kafka_config={"bootstrap.servers": bootstrap}, leader_topic=leader,
        leader_group=leader, listen=listen, limits=Limits(heartbeat_timeout=2.0, mark_backoff=mark_backoff)))
    harvester.start()
    wait_until(lambda: harvester.is_leader, 30, "leadership")
    time.sleep(0.5)  # the first mark finds nothing: the leader is now idle in its backoff
    return harvester


def test_notify_wakes_an_idle_leader_at_once(database_url, bootstrap_servers, new_topic):
    topic = new_topic("wakeup")
    # With a one-minute idle backoff, only the NOTIFY can get this record out within the bound.
    harvester = start_harvester(database_url, bootstrap_servers, mark_backoff=60.0)
    try:
        with transaction.atomic():
            stash(topic, "k", "v")
        wait_until(lambda: outbox_count(database_url) == 0, 15, "the notified record to be published")
    finally:
        harvester.stop()
        harvester.wait(timeout=30)


def test_plain_sql_rows_are_found_by_polling(database_url, bootstrap_servers, new_topic):
    topic = new_topic("polling")
    harvester = start_harvester(database_url, bootstrap_servers, mark_backoff=0.2)
    try:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("INSERT INTO outbox (create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, "
                         "kafka_header_values) VALUES (NOW(), %s, 'k', 'v', '{}', '{}')", [topic])
        wait_until(lambda: outbox_count(database_url) == 0, 15, "the row to be found by polling")
    finally:
        harvester.stop()
        harvester.wait(timeout=30)
    assert read_topic(bootstrap_servers, topic, expected=1).messages == 1


GOHARVEST_DDL = """
CREATE TABLE {table} (
  id                  BIGSERIAL PRIMARY KEY,
  create_time         TIMESTAMP WITH TIME ZONE NOT NULL,
  kafka_topic         VARCHAR(249) NOT NULL,
  kafka_key           VARCHAR(100) NOT NULL,
  kafka_value         VARCHAR(10000),
  kafka_header_keys   TEXT[] NOT NULL,
  kafka_header_values TEXT[] NOT NULL,
  leader_id           UUID
)"""


def test_sidecar_harvests_a_goharvest_table_in_another_schema(database_url, bootstrap_servers, new_topic):
    topic = new_topic("sidecar")
    schema = f"app_{uuid.uuid4().hex[:8]}"
    table = f"{schema}.events_outbox"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(GOHARVEST_DDL.format(table=table))
        with conn.transaction():
            for i in range(50):
                conn.execute(f"INSERT INTO {table} (create_time, kafka_topic, kafka_key, kafka_value, "
                             "kafka_header_keys, kafka_header_values) VALUES (NOW(), %s, %s, %s, %s, %s)",
                             [topic, f"k{i % 5}", str(i), ["applicationId"], ["legacy-app"]])
    harvester = start_harvester(database_url, bootstrap_servers, table=table, mark_backoff=0.05)
    try:
        def remaining() -> int:
            with psycopg.connect(database_url) as conn:
                return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]

        wait_until(lambda: remaining() == 0, 30, "the sidecar table to drain")
    finally:
        harvester.stop()
        harvester.wait(timeout=30)
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")
    audit = read_topic(bootstrap_servers, topic, expected=50)
    assert audit.messages == 50 and not audit.reversals()
