"""Fuzzed, not listed: whatever an application hands stash(), stash_many() or the queue's send(), either
InvalidRecord is raised, nothing was written and the transaction is still usable, or the record reaches
Kafka through a real harvester byte for byte (key, value, headers in order with repeats, tombstones as
tombstones). Profiles: tests/conftest.py ("ci" derandomized; OUTBOX_FUZZ_PROFILE=long for thousands).
"""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test import override_settings
from hypothesis import given
from hypothesis import strategies as st

from outbox import InvalidRecord, stash, stash_many
from outbox import queue as outbox_queue
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.harvester import Harvester
from outbox.queue import markers
from project.settings import queue_names
from tests.support import fuzz

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def rows_after(newest: int) -> int:
    """Rows in the outbox newer than id `newest` (ids only grow: the harvester may purge older ones meanwhile)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM outbox WHERE id > %s", [newest])
        return cursor.fetchone()[0]


def newest_row() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT coalesce(max(id), 0) FROM outbox")
        return cursor.fetchone()[0]


@pytest.fixture
def fuzz_topics(new_topic) -> list[str]:
    return [new_topic("fuzz", partitions=2), new_topic("fuzz.b", partitions=1)]


@pytest.fixture
def harvester(database_url, bootstrap_servers):
    leader = f"test-leader-{uuid.uuid4().hex[:8]}"
    running = Harvester(HarvestConfig(dsn=database_url, base_kafka_config={"bootstrap.servers": bootstrap_servers},
                                      leader_topic=leader, leader_group=leader,
                                      limits=Limits(heartbeat_timeout=2.0, status_interval=0)))
    running.start()
    yield running
    running.stop()
    running.wait(timeout=30)


def report(what: str, outcomes: Counter[str]) -> None:
    """How many examples went each way (shown with -s): a run that delivered none proved little."""
    print(f"{what}: {outcomes['delivered']} delivered byte-exact, {outcomes['refused']} refused")
    assert outcomes["delivered"] >= 5, outcomes


def test_stash_refuses_or_delivers_byte_exact(fuzz_topics, harvester, bootstrap_servers):
    reader = fuzz.TopicReader(bootstrap_servers, fuzz_topics, "outbox-id")
    outcomes: Counter[str] = Counter()

    @given(batch=st.lists(fuzz.records(fuzz_topics), min_size=1, max_size=3), one=st.booleans())
    def check(batch, one):
        newest = newest_row()  # the previous example's rows may still await their purge
        with transaction.atomic():
            try:
                ids = [stash(**batch[0])] if one else stash_many(batch)
            except InvalidRecord as error:
                outcomes["refused"] += 1
                assert error.field and str(error).startswith(f"{error.field}: "), str(error)
                assert rows_after(newest) == 0, "a refused record wrote nothing (and the transaction still works)"
                return
        outcomes["delivered"] += 1
        sent = batch[:1] if one else batch
        for record, messages in zip(sent, reader.read([str(i) for i in ids], "the accepted records"),
                                    strict=True):
            message = messages[0]
            assert message.topic() == record["topic"]
            assert message.key() == record["key"].encode()
            assert fuzz.same_value(record.get("value"), message.value()), (record.get("value"), message.value())
            headers = [(name, value or b"") for name, value in message.headers()]
            assert headers[:-2] == fuzz.expected_headers(record.get("headers"))
            assert [name for name, _ in headers[-2:]] == ["outbox-id", "outbox-create-time"]

    try:
        check()
    finally:
        reader.close()
    report("stash", outcomes)


def test_queue_send_refuses_or_delivers_byte_exact(bootstrap_servers):
    names = queue_names(f"fuzz-queue-{uuid.uuid4().hex[:8]}")
    with override_settings(OUTBOX={**settings.OUTBOX, "queues": names}):
        reader = fuzz.TopicReader(bootstrap_servers, [], markers.ID_HEADER)
        queues = fuzz.mostly(st.sampled_from(["emails", "q.1"]), fuzz.TEXT | st.integers())
        payloads = st.lists(fuzz.VALUES, min_size=1, max_size=3)
        created = {"done": False}
        outcomes: Counter[str] = Counter()

        @given(queue=queues, payloads=payloads, headers=fuzz.HEADERS)
        def check(queue, payloads, headers):
            try:
                ids = outbox_queue.send_many(queue, payloads, headers=headers)
            except InvalidRecord as error:
                outcomes["refused"] += 1
                assert error.field and str(error).startswith(f"{error.field}: "), str(error)
                return
            outcomes["delivered"] += 1
            if not created["done"]:  # the first send created the topic pair
                reader.consumer.close()
                reader.__init__(bootstrap_servers, [names["topic"]], markers.ID_HEADER)
                created["done"] = True
            for payload, messages in zip(payloads, reader.read(ids, "the sent messages"), strict=True):
                message = messages[0]
                assert message.key() == queue.encode()
                assert fuzz.same_value(payload, message.value())
                headers_held = [(name, value or b"") for name, value in message.headers()]
                assert headers_held[:-1] == fuzz.expected_headers(headers)
                assert headers_held[-1][0] == markers.ID_HEADER

        try:
            check()
        finally:
            reader.close()
        report("queue send", outcomes)
