"""Several records of one key in flight (max_in_flight_per_key > 1) against the real broker, through
permanent failures in the middle of a key's run: a record too large for its topic, and the topic
deleted and re-created. Checked with a live consumer: nothing lost, and no record published for the
first time after a later record of its key (repeats of records already published are allowed)."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from confluent_kafka import KafkaError, KafkaException, TopicCollection
from confluent_kafka.admin import AdminClient, NewTopic
from django.db import transaction

from outbox import stash_many
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.harvester import Harvester
from tests.support.harness import LiveConsumer, assert_complete_and_ordered, outbox_count, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

LIMIT_BYTES = 200_000


def stash_burst(topic: str, start: int, count: int, keys: int) -> list[int]:
    records = [{"topic": topic, "key": "hot" if i % 4 else f"k{i % keys}", "value": f"v{start + i}"}
               for i in range(count)]
    with transaction.atomic():
        return stash_many(records)


def topic_id(admin: AdminClient, topic: str) -> str | None:
    """The topic's id, None while it does not exist: a topic that the running producer re-created (auto-create)
    as soon as it was deleted has another id, where waiting for its name to go could wait for ever."""
    try:
        return str(admin.describe_topics(TopicCollection([topic]))[topic].result(10).topic_id)
    except KafkaException as error:
        if error.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
            raise
        return None


def test_a_hot_key_pipelined_through_a_poison_record_and_a_deleted_topic(database_url, bootstrap_servers):
    topic = f"pipelined-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})

    def create() -> None:
        future = admin.create_topics([NewTopic(topic, 1, 1, config={"max.message.bytes": str(LIMIT_BYTES)})])[topic]
        try:
            future.result(30)
        except KafkaException as error:  # the running producer may have re-created it first (auto-create)
            if error.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise

    create()
    consumer = LiveConsumer(bootstrap_servers, topic)
    consumer.start()
    leader = f"test-leader-{uuid.uuid4().hex[:8]}"
    harvester = Harvester(HarvestConfig(
        dsn=database_url, base_kafka_config={"bootstrap.servers": bootstrap_servers}, leader_topic=leader,
        leader_group=leader, limits=Limits(heartbeat_timeout=2.0, max_in_flight_per_key=64, mark_query_records=500,
                                           max_in_flight_records=2000)))
    harvester.start()
    stashed: list[int] = []
    try:
        stashed += stash_burst(topic, 0, 3000, keys=5)
        with transaction.atomic():  # a poison record in the middle of the hot key's run
            [poison] = stash_many([{"topic": topic, "key": "hot", "value": "x" * (2 * LIMIT_BYTES)}])
        stashed += stash_burst(topic, 3000, 3000, keys=5)
        wait_until(lambda: [h.id for h in harvester.held] == [poison], 60, "the poison record held")
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("UPDATE outbox SET kafka_value = 'fixed' WHERE id = %s", [poison])
        wait_until(lambda: outbox_count(database_url) == 0, 60, "the hot key to flow again and drain")
        wait_until(lambda: set(stashed) | {poison} <= consumer.seen(), 60, "the consumer to see everything so far")

        # The topic goes away under a running stream and comes back.
        more = stash_burst(topic, 6000, 3000, keys=5)
        first_id = topic_id(admin, topic)
        admin.delete_topics([topic])[topic].result(30)
        wait_until(lambda: topic_id(admin, topic) != first_id, 60, "the topic to be deleted (or re-created)")
        create()
        after = stash_burst(topic, 9000, 3000, keys=5)
        wait_until(lambda: outbox_count(database_url) == 0, 120, "the outbox to drain after the topic came back")
        wait_until(lambda: set(after) <= consumer.seen(), 60, "the consumer to see what came after")
        assert harvester.state.value == "running"
    finally:
        harvester.stop()
        harvester.wait(timeout=30)
        audit = consumer.stop()
    # Records acknowledged by the deleted topic went with it; everything else arrived, in order.
    assert_complete_and_ordered(audit, [*stashed, poison, *after], strict=False)
    assert audit.by_key["hot"].index(poison) < min(audit.by_key["hot"].index(i) for i in after[:10] if i in
                                                   audit.by_key["hot"])
    del more
