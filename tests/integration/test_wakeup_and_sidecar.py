"""Wake-ups: the table's trigger NOTIFYs for every writer (stash() and plain SQL alike), an idle
leader polls at most once a second, a table without the trigger is polled, and a table no Django
model owns is harvested."""

from __future__ import annotations

import time
import uuid

import psycopg
import pytest
from django.db import transaction

from outbox import stash
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.harvester import Harvester
from outbox.harvest.instruments import Instruments
from tests.support.harness import GOHARVEST_DDL, outbox_count, read_topic, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


class CountingInstruments(Instruments):
    def __init__(self) -> None:
        self.marks = 0

    def marked(self, seconds: float, rows: int) -> None:
        self.marks += 1


def start_harvester(database_url: str, bootstrap: str, *, table: str = "outbox", instruments: Instruments | None = None,
                    **limits: float) -> Harvester:
    leader = f"test-leader-{uuid.uuid4().hex[:8]}"
    harvester = Harvester(HarvestConfig(
        dsn=database_url, table=table, base_kafka_config={"bootstrap.servers": bootstrap}, leader_topic=leader,
        leader_group=leader, limits=Limits(heartbeat_timeout=2.0, **limits)), instruments=instruments)
    harvester.start()
    wait_until(lambda: harvester.is_leader, 30, "leadership")
    return harvester


def insert_plain(database_url: str, topic: str, table: str = "outbox") -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"INSERT INTO {table} (create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, "
                     "kafka_header_values) VALUES (NOW(), %s, 'k', 'v', '{}', '{}')", [topic])


@pytest.mark.parametrize("writer", ["stash", "plain SQL"])
def test_every_writer_wakes_an_idle_leader(database_url, bootstrap_servers, new_topic, writer):
    topic = new_topic("wakeup")
    # An idle leader polls once a minute here: only the trigger's NOTIFY can get the record out in time.
    harvester = start_harvester(database_url, bootstrap_servers, idle_poll_interval=60.0)
    try:
        if writer == "stash":
            with transaction.atomic():
                stash(topic, "k", "v")
        else:
            insert_plain(database_url, topic)
        wait_until(lambda: outbox_count(database_url) == 0, 15, f"the record written by {writer} to be published")
    finally:
        harvester.stop()
        harvester.wait(timeout=30)


def test_an_idle_leader_polls_at_most_once_a_second(database_url, bootstrap_servers):
    instruments = CountingInstruments()
    harvester = start_harvester(database_url, bootstrap_servers, instruments=instruments)
    try:
        wait_until(lambda: instruments.marks >= 1, 10, "the first mark")
        start = instruments.marks
        wait_until(lambda: instruments.marks >= start + 3, 10, "three more idle polls")
        began = time.monotonic()
        wait_until(lambda: instruments.marks >= start + 6, 15, "six more idle polls")
        seconds = time.monotonic() - began
    finally:
        harvester.stop()
        harvester.wait(timeout=30)
    # Three polls took at least two idle intervals (1 s each): the leader does not spin.
    assert seconds >= 2.0, f"3 idle polls in {seconds:.2f}s"


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
    # No trigger on this table: the leader polls it every mark_backoff instead.
    harvester = start_harvester(database_url, bootstrap_servers, table=table, mark_backoff=0.05,
                                idle_poll_interval=60.0)

    def remaining() -> int:
        with psycopg.connect(database_url) as conn:
            return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]

    try:
        wait_until(lambda: remaining() == 0, 30, "the sidecar table to drain")
        insert_plain(database_url, topic, table)
        wait_until(lambda: remaining() == 0, 15, "a later row to be found by polling")
    finally:
        harvester.stop()
        harvester.wait(timeout=30)
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")
    audit = read_topic(bootstrap_servers, topic, expected=51)
    assert audit.messages == 51 and not audit.reversals()
