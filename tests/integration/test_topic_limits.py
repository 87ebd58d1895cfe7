"""Topics with a small max.message.bytes, against a real broker (outbox/harvest/topics.py).

The harvester reads each topic's limit before producing to it, builds batches that fit it, and holds
a record that cannot fit even alone, naming the limit, before producing it: no producer restart, no
record of another key published twice, no flood of log lines. Without this, a broker refusing whole
batches made the idempotent producer fail fatally over and over, and with a limit of a few KB no
record of any key went out at all. The queue's producers likewise.
"""

from __future__ import annotations

import logging
import time
import uuid

import pytest
from confluent_kafka import KafkaError, Producer
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic, ResourceType
from django.db import transaction

from outbox import InvalidRecord, stash_many
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.harvester import Harvester
from outbox.kafka.sizes import record_size
from outbox.queue import api
from outbox.queue.topics import MARKERS_TOPIC_CONFIG
from tests.support.harness import assert_complete_and_ordered, outbox_count, read_topic, wait_until
from tests.support.queue_harness import new_prefix, queue_settings

# Kafka's topic limits: the same on any PostgreSQL server (not in make test-postgres18)
pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True), pytest.mark.postgres_agnostic]

#: The load of the issue's reproduction: 20,000 small records over 100 keys, one record too large.
RECORDS = 20_000
#: What a harvester that restarts its producer, or re-sends, or logs per batch, would exceed many times over.
MAX_WARNINGS = 10


def create_topic(bootstrap: str, limit: int | None) -> str:
    name = f"limits-{uuid.uuid4().hex[:10]}"
    config = {"max.message.bytes": str(limit)} if limit else {}
    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept alive until the answer is in
    admin.create_topics([NewTopic(name, 3, 1, config=config)])[name].result(30)
    return name


def lower_limit(bootstrap: str, topic: str, limit: int) -> None:
    resource = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[
        ConfigEntry("max.message.bytes", str(limit), incremental_operation=AlterConfigOpType.SET)])
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(30)


def stash_load(topic: str, big_value_bytes: int) -> tuple[int, list[int], list[int]]:
    """RECORDS small records over 100 keys, and key 'big' whose first record is `big_value_bytes` long."""
    records = [{"topic": topic, "key": f"k{i % 100}", "value": f"value {i:06d} " * 4,
                "headers": [("trace", f"t{i}")]} for i in range(RECORDS)]
    records.insert(RECORDS // 2, {"topic": topic, "key": "big", "value": "x" * big_value_bytes})
    records.extend({"topic": topic, "key": "big", "value": f"after {n}"} for n in range(3))
    with transaction.atomic():
        ids = stash_many(records)
    big = [record_id for record_id, record in zip(ids, records, strict=True) if record["key"] == "big"]
    return big[0], big[1:], [record_id for record_id in ids if record_id not in big]


def start(database_url: str, bootstrap: str, **limits: float) -> Harvester:
    leader = f"test-leader-{uuid.uuid4().hex[:8]}"
    harvester = Harvester(HarvestConfig(dsn=database_url, base_kafka_config={"bootstrap.servers": bootstrap},
                                        leader_topic=leader, leader_group=leader,
                                        limits=Limits(heartbeat_timeout=2.0, **limits)))
    harvester.start()
    return harvester


def assert_held_alone_and_the_rest_published_once(database_url: str, bootstrap: str, harvester: Harvester,
                                                  topic: str, limit: int, caplog: pytest.LogCaptureFixture,
                                                  earlier: int = 0) -> None:
    big, after, innocent = stash_load(topic, big_value_bytes=limit + limit // 2)
    wait_until(lambda: outbox_count(database_url) == 1 + len(after), 120,
               "every other key's records published, key 'big' waiting behind its record")
    [held] = harvester.held
    assert held.id == big and held.key == "big"
    assert held.reason.startswith("too large: ") and f"max.message.bytes of {limit:,}" in held.reason, held.reason
    assert "not produced" in held.reason
    audit = read_topic(bootstrap, topic, expected=earlier + len(innocent))
    assert audit.duplicates == 0, f"{audit.duplicates} record(s) published twice"
    assert_complete_and_ordered(audit, innocent)
    assert "big" not in audit.by_key
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("outbox")]
    assert not [m for m in messages if "producer failed" in m or "Replaced the record producer" in m], messages
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("outbox") and r.levelno >= logging.WARNING]
    assert len(warnings) <= MAX_WARNINGS, warnings


@pytest.mark.parametrize("limit", [64 * 1024, 3000], ids=["64 KiB", "3,000 bytes"])
def test_batches_fit_a_small_topic_and_a_record_too_large_for_it_is_held_before_it_is_produced(
        database_url, bootstrap_servers, caplog, limit):
    caplog.set_level(logging.INFO, logger="outbox")
    topic = create_topic(bootstrap_servers, limit)
    harvester = start(database_url, bootstrap_servers)
    try:
        assert_held_alone_and_the_rest_published_once(database_url, bootstrap_servers, harvester, topic, limit,
                                                      caplog)
        assert harvester.topic_limits[topic] == limit
    finally:
        harvester.stop()
        harvester.wait(timeout=30)


def test_a_limit_lowered_while_the_harvester_runs_is_learned_and_respected(database_url, bootstrap_servers, caplog):
    caplog.set_level(logging.INFO, logger="outbox")
    topic = create_topic(bootstrap_servers, None)
    harvester = start(database_url, bootstrap_servers, topic_limits_interval=1.0)
    try:
        with transaction.atomic():
            stash_many([{"topic": topic, "key": f"k{i % 100}", "value": "before " * 20} for i in range(2000)])
        wait_until(lambda: outbox_count(database_url) == 0, 60, "the first records published, in big batches")
        assert harvester.topic_limits[topic] > 1_000_000, "the broker's default"
        lower_limit(bootstrap_servers, topic, 3000)
        wait_until(lambda: harvester.topic_limits[topic] == 3000, 10, "the harvester to read the lowered limit")
        caplog.clear()
        assert_held_alone_and_the_rest_published_once(database_url, bootstrap_servers, harvester, topic, 3000,
                                                      caplog, earlier=2000)
    finally:
        harvester.stop()
        harvester.wait(timeout=30)


def test_a_held_record_retried_after_its_topic_limit_was_raised_goes_out_at_once(database_url, bootstrap_servers,
                                                                               caplog, monkeypatch):
    """The operator's way (docs/operations.md, "Retry now"): raise the topic's max.message.bytes, then retry the held
    record. The limit the harvester read is older than RECHECK_AGE, so the record waits for it to be read again
    rather than failing again on the old one (an attempt lost, and the automatic retries backing off)."""
    from outbox.console.operations import retry_now
    from outbox.harvest import topics
    from outbox.states import Facts

    monkeypatch.setattr(topics, "RECHECK_AGE", 0.5)
    caplog.set_level(logging.INFO, logger="outbox")
    topic = create_topic(bootstrap_servers, 3000)
    harvester = start(database_url, bootstrap_servers)
    try:
        with transaction.atomic():
            big, after = stash_many([{"topic": topic, "key": "big", "value": "x" * 4500},
                                     {"topic": topic, "key": "big", "value": "after"}])
        wait_until(lambda: [held.id for held in harvester.held] == [big], 60, "the record too large to be held")
        lower_limit(bootstrap_servers, topic, 100_000)
        time.sleep(0.6)  # what the test waits for is the limit's age passing RECHECK_AGE (0.5 s here)
        facts = wait_until(lambda: next((found for found in [Facts.read("default")] if big in found.held), None), 30,
                           "the status row to say it is held, as the console reads it")
        assert retry_now([big], facts, "tester").done == [big]
        wait_until(lambda: outbox_count(database_url) == 0, 30, "the retried record and the next one published")
    finally:
        harvester.stop()
        harvester.wait(timeout=30)
    assert not [r.getMessage() for r in caplog.records if "failed again" in r.getMessage()]
    assert read_topic(bootstrap_servers, topic, expected=2).by_key["big"] == [big, after]


def test_the_queue_producers_fit_small_topics_and_refuse_a_message_too_large_for_them(settings, bootstrap_servers):
    names = queue_settings(new_prefix())
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    small = {"max.message.bytes": "3000"}
    for future in admin.create_topics([
            NewTopic(names["topic"], 4, 1, config=small),
            NewTopic(names["markers_topic"], 2, 1, config={**small, **MARKERS_TOPIC_CONFIG})]).values():
        future.result(30)
    settings.OUTBOX = {**settings.OUTBOX, "queues": names}
    with pytest.raises(InvalidRecord) as raised:
        api.send("letters", "x" * 2900)
    assert raised.value.field == "payload" and "at most 3,000 (max.message.bytes)" in str(raised.value)
    with pytest.raises(InvalidRecord, match=r"^payloads\[1\]: too large"):
        api.send_many("letters", ["fine", "x" * 4000])
    # Hundreds of small messages: batched past 3,000 bytes, the broker would refuse them (QueueError).
    ids = api.send_many("letters", [f"letter {n:04d} " * 8 for n in range(500)])
    seen = set()
    with api.consumer("letters", max_in_progress=100) as consumer:  # Start and End markers: batches too
        while len(seen) < len(ids):
            message = wait_until(lambda: consumer.receive(timeout=0.5), 60, "the small queue's messages")
            seen.add(message.id)
            message.ack()
    assert seen == set(ids)


def test_a_record_s_size_is_what_the_broker_measures_against_max_message_bytes(bootstrap_servers):
    """record_size() to the byte: a record of exactly the limit is taken, one byte more refused."""
    topic = create_topic(bootstrap_servers, 3000)
    producer = Producer({"bootstrap.servers": bootstrap_servers, "enable.idempotence": True, "linger.ms": 0})
    headers = [("outbox-id", "12345"), ("outbox-create-time", "2026-11-21T23:47:08.171250Z"), ("trace", "é")]
    answers = {}
    for target in (3000, 3001):
        length = next(n for n in range(3000) if record_size("key-é", "v" * n, headers) == target)
        producer.produce(topic, key="key-é", value="v" * length, headers=headers,
                         on_delivery=lambda error, _message, target=target: answers.__setitem__(target, error))
        assert producer.flush(30) == 0
    assert answers[3000] is None
    assert answers[3001] is not None and answers[3001].code() == KafkaError.MSG_SIZE_TOO_LARGE
