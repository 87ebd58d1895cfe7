"""Each replica's status row: written while it runs, gone when it stops; long-gone rows are pruned."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.harvester import Harvester
from outbox.models import HarvesterStatus
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
    assert not HarvesterStatus.objects.filter(name="status-replica").exists(), "a stopped replica removes its row"


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
