"""Poison records against a real broker: a record too large for its topic is refused with the
innocent records batched beside it. Only the guilty one is held; its key waits while every other
key flows; deleting, fixing or parking its row releases the key while the leader keeps running."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from django.db import transaction

from outbox import stash_many
from outbox.harvest import events
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.harvester import Harvester
from outbox.models import DeadLetter
from tests.support.harness import SMALL_TOPIC_BYTES, assert_complete_and_ordered, outbox_count, read_topic, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]




def stash_with_poison(topic: str) -> tuple[int, list[int], list[int]]:
    """Ten innocent keys, and key 'bad' whose first record is too large for the topic."""
    records = []
    for i in range(60):
        records.append({"topic": topic, "key": f"k{i % 10}", "value": f"v{i}" * 20})
        if i == 5:
            records.append({"topic": topic, "key": "bad", "value": "x" * (2 * SMALL_TOPIC_BYTES)})
        if i in (20, 40):
            records.append({"topic": topic, "key": "bad", "value": f"after-{i}"})
    with transaction.atomic():
        ids = stash_many(records)
    bad = [record_id for record_id, record in zip(ids, records, strict=True) if record["key"] == "bad"]
    return bad[0], bad[1:], [i for i in ids if i not in bad]


def start(database_url: str, bootstrap: str, per_key: int, **config: object) -> tuple[Harvester, list]:
    leader = f"test-leader-{uuid.uuid4().hex[:8]}"
    seen: list = []
    harvester = Harvester(HarvestConfig(
        dsn=database_url, base_kafka_config={"bootstrap.servers": bootstrap}, leader_topic=leader, leader_group=leader,
        limits=Limits(heartbeat_timeout=2.0, max_in_flight_per_key=per_key), **config), on_event=seen.append)
    harvester.start()
    return harvester, seen


def held_ids(seen: list) -> list[int]:
    return [e.record_id for e in seen if isinstance(e, events.RecordHeld)]


def row_exists(database_url: str, record_id: int) -> bool:
    with psycopg.connect(database_url) as conn:
        return conn.execute("SELECT 1 FROM outbox WHERE id = %s", [record_id]).fetchone() is not None


@pytest.mark.parametrize("per_key", [1, 8], ids=["one per key", "pipelined"])
def test_only_the_guilty_record_is_held_and_fixing_its_row_releases_the_key(database_url, bootstrap_servers,
                                                                            small_topic, per_key):
    poison, after, innocent = stash_with_poison(small_topic)
    harvester, seen = start(database_url, bootstrap_servers, per_key)
    try:
        wait_until(lambda: outbox_count(database_url) == 1 + len(after), 60,
                   "every innocent record published, the bad key waiting")
        assert held_ids(seen) == [poison], "only the record too large for the topic is held"
        [held] = harvester.held
        assert held.id == poison and held.key == "bad" and "too large" in held.reason.lower()
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("UPDATE outbox SET kafka_value = 'fixed' WHERE id = %s", [poison])
        wait_until(lambda: outbox_count(database_url) == 0, 15, "the fixed record and its key's later ones to go")
        wait_until(lambda: not harvester.held, 5, "the key to be reported released")
        assert harvester.state.value == "running"
    finally:
        harvester.stop()
        harvester.wait(timeout=30)
    audit = read_topic(bootstrap_servers, small_topic, expected=len(innocent) + 1 + len(after))
    assert_complete_and_ordered(audit, [*innocent, poison, *after], strict=per_key == 1)
    assert audit.by_key["bad"][:3] == [poison, *after]


def test_deleting_the_poison_row_releases_its_key(database_url, bootstrap_servers, small_topic):
    poison, after, innocent = stash_with_poison(small_topic)
    harvester, seen = start(database_url, bootstrap_servers, 1)
    try:
        wait_until(lambda: held_ids(seen) == [poison] and outbox_count(database_url) == 1 + len(after), 60,
                   "the poison record held and the others published")
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("DELETE FROM outbox WHERE id = %s", [poison])
        wait_until(lambda: outbox_count(database_url) == 0, 15, "the bad key's later records to go")
        assert any(isinstance(e, events.RecordReleased) and e.record_id == poison for e in seen)
    finally:
        harvester.stop()
        harvester.wait(timeout=30)
    audit = read_topic(bootstrap_servers, small_topic, expected=len(innocent) + len(after))
    assert_complete_and_ordered(audit, innocent + after)


def test_park_after_moves_the_poison_to_the_dead_letter_table_and_its_key_goes_on(database_url, bootstrap_servers,
                                                                                  small_topic):
    poison, after, innocent = stash_with_poison(small_topic)
    harvester, seen = start(database_url, bootstrap_servers, 1, park_after=1)
    try:
        wait_until(lambda: outbox_count(database_url) == 0, 60, "everything but the poison published, it parked")
    finally:
        harvester.stop()
        harvester.wait(timeout=30)
    parked = DeadLetter.objects.get(outbox_id=poison)
    assert parked.kafka_key == "bad" and parked.attempts == 1 and "too large" in parked.reason.lower()
    assert parked.parked_by.startswith("harvester ")
    assert not row_exists(database_url, poison)
    assert any(isinstance(e, events.RecordParked) and e.record_id == poison for e in seen)
    audit = read_topic(bootstrap_servers, small_topic, expected=len(innocent) + len(after))
    assert_complete_and_ordered(audit, innocent + after)
