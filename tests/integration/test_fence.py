"""The database fence against real Postgres and Kafka: one table, one publisher.

- Two leader groups on one table (a deployment mistake): one leads, the other is blocked and says
  by whom; when the first goes, the second takes over; no key is ever reordered.
- A leader frozen (SIGSTOP) past its session timeout while records flow: a standby of its group
  takes over and ends the frozen leader's database session; when it thaws, it publishes nothing
  out of order.
"""

from __future__ import annotations

import signal
import uuid

import psycopg
import pytest

from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.contract import ReplicaState
from outbox.harvest.harvester import Harvester
from outbox.models import HarvesterStatus
from tests.support.harness import (
    Generator,
    Replica,
    assert_complete_and_ordered,
    outbox_count,
    read_topic,
    replica_env,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def harvester_in(group: str, name: str, database_url: str, bootstrap: str) -> Harvester:
    return Harvester(HarvestConfig(dsn=database_url, base_kafka_config={"bootstrap.servers": bootstrap},
                                   leader_topic=group, leader_group=group, name=name,
                                   limits=Limits(heartbeat_timeout=2.0, status_interval=0.3)))


def test_two_leader_groups_on_one_table_never_publish_at_once(database_url, bootstrap_servers, new_topic):
    topic = new_topic("two-groups")
    suffix = uuid.uuid4().hex[:8]
    first = harvester_in(f"group-a-{suffix}", "replica-a", database_url, bootstrap_servers)
    second = harvester_in(f"group-b-{suffix}", "replica-b", database_url, bootstrap_servers)
    generator = Generator(topic, keys=50, pause=0.005)
    first.start()
    try:
        wait_until(lambda: first.is_leader, 30, "group a's replica to lead")
        second.start()
        wait_until(lambda: second.replica_state is ReplicaState.BLOCKED, 30, "group b's leader to be blocked")
        assert not second.is_leader
        status = wait_until(lambda: HarvesterStatus.objects.filter(name="replica-b", state="blocked").first(), 10,
                            "the blocked replica's status row")
        assert "replica-a" in status.blocked_by and f"group-a-{suffix}" in status.blocked_by
        generator.start()
        wait_until(lambda: len(generator.ids) >= 2000, 60, "2000 records stashed under group a")
        first.stop()  # group a goes: group b takes the fence over, after letting a's last records land
        first.wait(timeout=30)
        wait_until(lambda: second.is_leader, 30, "group b's replica to lead")
        wait_until(lambda: len(generator.ids) >= 4000, 60, "2000 more records stashed under group b")
        stashed = generator.stop()
        wait_until(lambda: outbox_count(database_url) == 0, 60, "the outbox to drain")
    finally:
        generator.halt.set()
        for harvester in (first, second):
            harvester.stop()
            harvester.wait(timeout=30)
    audit = read_topic(bootstrap_servers, topic, expected=len(stashed))
    assert_complete_and_ordered(audit, stashed)


@pytest.mark.slow
def test_a_frozen_leader_past_its_session_timeout_is_fenced_out(database_url, bootstrap_servers, new_topic, tmp_path):
    """Slow: a leader frozen (SIGSTOP) past Kafka's session timeout, then thawed."""
    topic = new_topic("frozen")
    env = replica_env(database_url, bootstrap_servers, f"test-leader-{uuid.uuid4().hex[:8]}")
    args = ["--heartbeat-timeout", "2", "--status-interval", "0.3"]
    replicas = [Replica(f"replica-{i}", env, tmp_path, args) for i in range(2)]
    generator = Generator(topic, keys=20, pause=0.01)
    try:
        leader = wait_until(lambda: next((r for r in replicas if r.is_leading()), None), 60, "a leader")
        standby = next(r for r in replicas if r is not leader)
        generator.start()
        wait_until(lambda: len(generator.ids) >= 1000, 60, "records flowing")
        leader.signal(signal.SIGSTOP)  # frozen, fence session and all, for twice the session timeout
        wait_until(standby.is_leading, 30, "the standby to take over")
        frozen_at = len(generator.ids)
        wait_until(lambda: len(generator.ids) >= frozen_at + 1000, 60, "the standby publishing, the old leader frozen")
        leader.signal(signal.SIGCONT)
        wait_until(lambda: len(generator.ids) >= 4000, 60, "more records after the thaw")
        stashed = generator.stop()
        wait_until(lambda: outbox_count(database_url) == 0, 60, "the outbox to drain")
        assert "Ending the database session of a stale leader" in standby.log()
    finally:
        generator.halt.set()
        for replica in replicas:
            replica.signal(signal.SIGCONT)
            replica.signal(signal.SIGTERM)
        for replica in replicas:
            replica.wait(timeout=60)
    audit = read_topic(bootstrap_servers, topic, expected=len(stashed))
    assert_complete_and_ordered(audit, stashed)
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM outbox").fetchone()[0] == 0


def fake_replica_of(group: str, table: str) -> None:
    from django.utils import timezone

    now = timezone.now()
    HarvesterStatus.objects.create(name="billing-replica", host="billing-host", pid=1, state="leader", since=now,
                                   started=now, last_seen=now, harvested_table=table, leader_topic=group,
                                   leader_group=group)


def test_a_group_shared_with_another_outbox_is_a_check_warning_and_a_log_error(database_url, bootstrap_servers,
                                                                                caplog):
    from django.core import checks

    from outbox import conf

    group = conf.harvest_config().leader_group
    fake_replica_of(group, "billing_outbox")
    messages = checks.run_checks(tags=[checks.Tags.database], databases=["default"])
    [warning] = [m for m in messages if m.id == "outbox.W002"]
    assert "billing-replica" in warning.msg and "'billing_outbox'" in warning.msg

    harvester = harvester_in(group, "replica-a", database_url, bootstrap_servers)
    harvester.start()
    try:
        wait_until(lambda: "is shared with replica billing-replica" in caplog.text, 15, "the shared group to be logged")
    finally:
        harvester.stop()
        harvester.wait(timeout=30)
