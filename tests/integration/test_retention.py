"""Retention of dead letters: the leading harvester deletes parked records older than dead_letter_retention
(and only those), a tracker does the same for the queues' dead letters; None keeps them."""

from __future__ import annotations

import uuid
from datetime import timedelta

import psycopg
import pytest
from django.utils import timezone

from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.harvester import Harvester
from outbox.harvest.retention import DeadLetterRetention
from outbox.models import DeadLetter
from outbox.queue.models import DeadLetter as QueueDeadLetter
from outbox.queue.status import QueueStatusReporter
from tests.support.harness import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def parked(days_ago: float, key: str) -> DeadLetter:
    letter = DeadLetter.objects.create(outbox_id=1, create_time=timezone.now(), kafka_topic="t", kafka_key=key,
                                       kafka_value="v", reason="too large", parked_by="test")
    DeadLetter.objects.filter(pk=letter.pk).update(parked_at=timezone.now() - timedelta(days=days_ago))
    return letter


def test_the_leader_deletes_dead_letters_past_their_retention_and_keeps_the_rest(database_url, bootstrap_servers):
    old, recent = parked(31, "old"), parked(29, "recent")
    leader = f"test-leader-{uuid.uuid4().hex[:8]}"
    harvester = Harvester(HarvestConfig(dsn=database_url, base_kafka_config={"bootstrap.servers": bootstrap_servers},
                                        leader_topic=leader, leader_group=leader, name="retention-replica",
                                        limits=Limits(heartbeat_timeout=2.0, status_interval=0.2)))
    harvester.start()
    try:
        wait_until(lambda: not DeadLetter.objects.filter(pk=old.pk).exists(), 30,
                   "the leader to delete the dead letter parked 31 days ago (retention 30 days)")
        assert DeadLetter.objects.filter(pk=recent.pk).exists(), "one parked 29 days ago is kept"
    finally:
        harvester.stop()
        harvester.wait(timeout=30)


@pytest.mark.parametrize(("retention", "leading", "left"), [
    (None, True, {"old", "recent"}),  # None: kept until an operator acts
    (30 * 86400.0, False, {"old", "recent"}),  # a standby leaves them to the leader
    (30 * 86400.0, True, {"recent"}),
    (3600.0, True, set()),
])
def test_a_retention_pass_deletes_only_what_it_should(database_url, retention, leading, left):
    parked(31, "old"), parked(29, "recent")
    retention_pass = DeadLetterRetention(HarvestConfig(dsn=database_url, dead_letter_retention=retention))
    with psycopg.connect(database_url, autocommit=True) as conn:
        deleted = retention_pass.run(conn, leading)
    assert set(DeadLetter.objects.values_list("kafka_key", flat=True)) == left
    assert deleted == 2 - len(left)


def test_a_missing_dead_letter_table_is_asked_about_once_and_never_an_error(database_url):
    retention_pass = DeadLetterRetention(HarvestConfig(dsn=database_url, dead_letter_table="no_such_dead_letters"))
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert retention_pass.run(conn, True) == 0


def test_a_tracker_deletes_queue_dead_letters_past_their_retention(db):
    letters = {}
    for name, days in (("old", 8), ("recent", 6)):
        letter = QueueDeadLetter.objects.create(queue="emails", message_id=name, deliveries=3,
                                                last_delivered=timezone.now())
        QueueDeadLetter.objects.filter(pk=letter.pk).update(created=timezone.now() - timedelta(days=days))
        letters[name] = letter.pk
    reporter = QueueStatusReporter("retention-tracker", "tracker", interval=0.1, snapshot=lambda: (0, {}),
                                   dead_letter_retention=7 * 86400.0)
    reporter.start()
    try:
        wait_until(lambda: not QueueDeadLetter.objects.filter(pk=letters["old"]).exists(), 30,
                   "the tracker to delete the dead letter of 8 days ago (retention 7 days)")
        assert QueueDeadLetter.objects.filter(pk=letters["recent"]).exists()
    finally:
        reporter.stop()
