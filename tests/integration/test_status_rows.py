"""Each replica's status row: written while it runs, marked stopped when it stops cleanly; long-gone rows are
pruned. Its history samples: taken with the status row, pruned after history_retention, off with history_interval 0."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from outbox import stash_many
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.harvester import Harvester
from outbox.models import HarvesterSample, HarvesterStatus, OutboxRecord
from tests.support.harness import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def test_status_row_follows_the_replica_and_stale_rows_are_pruned(database_url, bootstrap_servers):
    long_ago = timezone.now() - timedelta(hours=2)
    HarvesterStatus.objects.create(name="crashed-last-week", host="h", pid=1, state="leader", since=long_ago,
                                   started=long_ago, last_seen=long_ago, harvested_table="outbox", leader_topic="t",
                                   leader_group="g")
    leader = f"test-leader-{uuid.uuid4().hex[:8]}"
    harvester = Harvester(HarvestConfig(dsn=database_url, base_kafka_config={"bootstrap.servers": bootstrap_servers},
                                        leader_topic=leader, leader_group=leader, name="status-replica",
                                        status_prune_after=3600, limits=Limits(heartbeat_timeout=2.0,
                                                                               status_interval=0.2)))
    harvester.start()
    try:
        # Leading, and past taking the fence: only then has the row a leader id.
        row = wait_until(lambda: HarvesterStatus.objects.filter(name="status-replica", state="leader",
                                                                leader_id__isnull=False).first(), 30,
                         "the leader's status row")
        assert row.leader_id == harvester.leader_id and row.leader_group == leader and row.harvested_table == "outbox"
        assert not HarvesterStatus.objects.filter(name="crashed-last-week").exists(), "stale rows are pruned"
        first_seen = row.last_seen
        wait_until(lambda: HarvesterStatus.objects.get(name="status-replica").last_seen > first_seen, 10,
                   "the row to be refreshed")
    finally:
        harvester.stop()
        harvester.wait(timeout=30)
    stopped = HarvesterStatus.objects.get(name="status-replica")
    assert stopped.state == "stopped" and stopped.leader_id is None and stopped.in_flight == 0, \
        "a replica that stopped cleanly says so in its row, until it is pruned"


def test_status_rows_can_be_turned_off(database_url, bootstrap_servers):
    leader = f"test-leader-{uuid.uuid4().hex[:8]}"
    harvester = Harvester(HarvestConfig(dsn=database_url, base_kafka_config={"bootstrap.servers": bootstrap_servers},
                                        leader_topic=leader, leader_group=leader, name="quiet-replica",
                                        limits=Limits(heartbeat_timeout=2.0, status_interval=0)))
    harvester.start()
    try:
        wait_until(lambda: harvester.is_leader, 30, "leadership")
        assert not HarvesterStatus.objects.filter(name="quiet-replica").exists()
    finally:
        harvester.stop()
        harvester.wait(timeout=30)


def test_the_history_samples_what_the_replica_did_and_old_samples_are_pruned(database_url, bootstrap_servers,
                                                                               new_topic):
    """Samples every history_interval: state, leadership, totals, in flight, the table's rows and oldest age."""
    long_ago = timezone.now() - timedelta(days=3)
    HarvesterSample.objects.create(name="crashed-last-week", at=long_ago, state="leader", since=long_ago,
                                   harvested_table="outbox", leader_group="g")
    topic = new_topic("history")
    with transaction.atomic():
        stash_many([{"topic": topic, "key": f"k{i % 3}", "value": str(i)} for i in range(30)])
    old = OutboxRecord.objects.order_by("id").first()
    OutboxRecord.objects.filter(pk=old.pk).update(create_time=timezone.now() - timedelta(minutes=10))
    leader = f"test-leader-{uuid.uuid4().hex[:8]}"
    # Samples taken before the leader publishes: the table's rows are counted, the oldest row is ten minutes old.
    harvester = Harvester(HarvestConfig(dsn=database_url, base_kafka_config={"bootstrap.servers": bootstrap_servers},
                                        leader_topic=leader, leader_group=leader, name="history-replica",
                                        history_retention=86400,
                                        limits=Limits(heartbeat_timeout=2.0, status_interval=0.1,
                                                      history_interval=0.1)))
    harvester.start()
    try:
        wait_until(lambda: not OutboxRecord.objects.exists(), 30, "the outbox to be drained")
        wait_until(lambda: HarvesterSample.objects.filter(name="history-replica", published=30).exists(), 10,
                   "a sample counting the 30 published records")
    finally:
        harvester.stop()
        harvester.wait(timeout=30)
    samples = list(HarvesterSample.objects.filter(name="history-replica").order_by("at"))
    assert not HarvesterSample.objects.filter(name="crashed-last-week").exists(), "old samples are pruned"
    assert len(samples) >= 2 and all(s.leader_group == leader and s.harvested_table == "outbox" for s in samples)
    assert [s.published for s in samples] == sorted(s.published for s in samples), "totals only grow"
    first_full = next(s for s in samples if s.backlog)
    assert first_full.backlog <= 30 and first_full.oldest_age >= 600
    last = samples[-1]
    assert last.backlog == 0 and last.oldest_age is None and last.in_flight == 0
    leading = [s for s in samples if s.state == "leader"]
    assert leading and {s.since for s in leading} == {leading[0].since}, "one acquisition, one `since`"
    assert leading[-1].leader_id is not None


def test_the_history_can_be_turned_off(database_url, bootstrap_servers):
    leader = f"test-leader-{uuid.uuid4().hex[:8]}"
    harvester = Harvester(HarvestConfig(dsn=database_url, base_kafka_config={"bootstrap.servers": bootstrap_servers},
                                        leader_topic=leader, leader_group=leader, name="no-history-replica",
                                        limits=Limits(heartbeat_timeout=2.0, status_interval=0.1,
                                                      history_interval=0)))
    harvester.start()
    try:
        wait_until(lambda: HarvesterStatus.objects.filter(name="no-history-replica", state="leader").exists(), 30,
                   "the leader's status row")
        status = HarvesterStatus.objects.get(name="no-history-replica")
        wait_until(lambda: HarvesterStatus.objects.get(name="no-history-replica").last_seen > status.last_seen, 10,
                   "a few more status rows")
        assert not HarvesterSample.objects.filter(name="no-history-replica").exists()
    finally:
        harvester.stop()
        harvester.wait(timeout=30)


@pytest.mark.parametrize("status_table, advice", [
    ("outbox_harvester_renamed", "manage.py migrate and outbox-harvest schema --apply create outbox_harvester, not "
                                 "outbox_harvester_renamed: leave status_table unset, or make outbox_harvester_renamed "
                                 "as they make outbox_harvester (outbox-harvest schema prints how)"),
    ("public.outbox_harvester_missing", "create outbox_harvester, not public.outbox_harvester_missing"),
])
def test_a_missing_status_table_of_another_name_says_how_to_make_it(status_table, advice, database_url,
                                                                     bootstrap_servers, caplog):
    """The migrations make the default-named tables only: a log line telling a user with their own status_table to
    migrate would send them in circles."""
    caplog.set_level("INFO", logger="outbox.harvest")
    leader = f"test-leader-{uuid.uuid4().hex[:8]}"
    harvester = Harvester(HarvestConfig(dsn=database_url, base_kafka_config={"bootstrap.servers": bootstrap_servers},
                                        leader_topic=leader, leader_group=leader, name="renamed-status",
                                        status_table=status_table, limits=Limits(heartbeat_timeout=2.0,
                                                                                 status_interval=0.2)))
    harvester.start()
    try:
        line = wait_until(lambda: next((r.getMessage() for r in caplog.records
                                        if r.getMessage().startswith("Status rows off")), None), 30,
                          "the status rows' note")
    finally:
        harvester.stop()
        harvester.wait(timeout=30)
    assert line.startswith(f"Status rows off: table {status_table} does not exist (") and advice in line, line
    assert "creates it" not in line


def test_a_missing_table_of_the_migrations_name_is_made_by_migrating():
    from outbox.harvest.store import how_made

    assert how_made("outbox_harvester", "outbox_harvester") == \
        how_made("tenant_a.outbox_harvester", "outbox_harvester") == \
        "manage.py migrate, or outbox-harvest schema --apply, creates it"
