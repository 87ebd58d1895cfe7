"""`harvest --metrics-port` and `harvest_health`, run as an operator (and Kubernetes) would."""

from __future__ import annotations

import io
import re
import signal
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import transaction
from django.utils import timezone

from outbox import stash_many
from outbox.harvest.contract import ReplicaState
from outbox.models import DeadLetter, HarvesterStatus, OutboxRecord
from tests.support.commands import manage
from tests.support.harness import Replica, outbox_count, replica_env, wait_until
from tests.support.metrics import scrape
from tests.support.services import free_port
from tests.support.status_rows import held_record, status_row

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]




def test_metrics_endpoint_and_health_probe_follow_a_running_harvester(database_url, bootstrap_servers, new_topic,
                                                                      tmp_path):
    topic = new_topic("metrics")
    port = free_port()
    env = replica_env(database_url, bootstrap_servers, f"test-leader-{uuid.uuid4().hex[:8]}")
    name = f"probe-{uuid.uuid4().hex[:6]}"
    replica = Replica(name, env, tmp_path, ["--metrics-port", str(port), "--metrics-address", "127.0.0.1",
                                           "--heartbeat-timeout", "2", "--status-interval", "0.5"])
    try:
        wait_until(replica.is_leading, 60, "leadership")
        # Every series names the replica and the outbox; the engine's also its shard (none: the whole table).
        replica_labels = f'name="{name}",outbox="outbox"'
        engine = f'{replica_labels},shard=""'
        with transaction.atomic():
            stash_many([{"topic": topic, "key": f"k{i % 5}", "value": str(i)} for i in range(200)])
        wait_until(lambda: outbox_count(database_url) == 0, 60, "the outbox to drain")
        metrics = wait_until(lambda: (m := scrape(port)).get(f'outbox_records_published_total{{{engine}}}')
                             == 200 and m, 30, "published_total to reach 200")
        assert metrics[f'outbox_leader_state{{{engine},state="leader"}}'] == 1.0
        assert metrics[f'outbox_in_flight_records{{{engine}}}'] == 0.0
        assert metrics["outbox_mark_seconds_count"] > 0 and metrics["outbox_purge_seconds_count"] > 0
        assert f'outbox_backlog_records{{{replica_labels}}}' in metrics
        assert metrics[f'outbox_held_records{{{engine}}}'] == 0.0
        assert metrics[f'outbox_parked_records{{{replica_labels}}}'] == 0.0
        assert metrics[f'outbox_oldest_record_age_seconds{{{replica_labels}}}'] == 0.0, "an empty outbox waits for none"
        assert _families(metrics) - _documented() == set(), "metrics docs/_ext/metric_reference.py misses"

        # A record too large for the producer is held; one parked earlier is in the dead-letter table.
        poison = OutboxRecord.objects.create(kafka_topic=topic, kafka_key="k0", kafka_value="x" * 1_200_000)
        DeadLetter.objects.create(outbox_id=1, create_time=timezone.now(), kafka_topic=topic, kafka_key="k1",
                                  reason="Broker: Message size too large", parked_by="admin root")
        wait_until(lambda: scrape(port).get(f'outbox_held_records{{{engine}}}') == 1.0, 30,
                   "the held gauge to count the poison record")
        assert scrape(port)[f'outbox_parked_records{{{replica_labels}}}'] == 1.0
        OutboxRecord.objects.filter(pk=poison.pk).update(create_time=timezone.now() - timedelta(minutes=10))
        assert 600 <= scrape(port)[f'outbox_oldest_record_age_seconds{{{replica_labels}}}'] < 700, "the held row's age"

        healthy = wait_until(lambda: (r := manage("harvest_health", "--name", name, "--require-leader", env=env))
                             .stdout.endswith("; 1 held, 1 parked\n") and r, 30, "the probe to count held records")
        assert healthy.returncode == 0, healthy.stdout + healthy.stderr
        assert healthy.stdout.startswith(f"ok: {name} is leader")
        assert manage("harvest_health", "--any", env=env).returncode == 0
        poison.delete()
    finally:
        replica.signal(signal.SIGTERM)
        assert replica.wait() == 0
    gone = manage("harvest_health", "--name", name, env=env)
    assert gone.returncode == 1 and gone.stdout.startswith(f"unhealthy: no live harvester for replica '{name}' "
                                                           f"({name} stopped cleanly at 20"), gone.stdout
    assert len(gone.stdout.strip().splitlines()) == 1
    never = manage("harvest_health", "--name", "never-ran", env=env)
    assert never.returncode == 1 and "(never seen;" in never.stdout, never.stdout


def test_health_fails_for_a_replica_not_seen_recently(services):
    now = timezone.now()
    HarvesterStatus.objects.create(name="stale", host="h", pid=1, state="leader", since=now, started=now,
                                   last_seen=now - timedelta(minutes=5), harvested_table="outbox", leader_topic="t",
                                   leader_group="g")
    from django.core.management import call_command

    out = io.StringIO()
    with pytest.raises(SystemExit) as exit_info:
        call_command("harvest_health", "--name", "stale", stdout=out)
    assert exit_info.value.code == 1
    assert "(stale last seen 3" in out.getvalue() and "s ago; gone after 20s)" in out.getvalue(), out.getvalue()


def test_health_fails_for_a_replica_blocked_by_the_fence_naming_the_holder(database_url):
    holder = "replica replica-a of leader group g on host-a (pid 1234)"
    leader_id = uuid.uuid4()
    poison = OutboxRecord.objects.create(kafka_topic="t", kafka_key="k", leader_id=leader_id, reset_count=1)
    status_row("replica-a", ReplicaState.LEADER, leader_id=leader_id, held=[held_record(poison.id, "k")])
    status_row("replica-b", ReplicaState.BLOCKED, group="billing", blocked_by=holder)
    for reason in ("Broker: Message size too large", "Broker: Topic authorization failed"):
        DeadLetter.objects.create(outbox_id=1, create_time=timezone.now(), kafka_topic="t", kafka_key="k",
                                  reason=reason, parked_by="admin root")
    env = {"DATABASE_URL": database_url}
    blocked = manage("harvest_health", "--name", "replica-b", env=env)
    assert blocked.returncode == 1 and blocked.stdout == (
        f"unhealthy: replica-b (leader group billing) is blocked: {holder} holds the table's database fence, so it "
        f"publishes nothing; 1 held, 2 parked\n")
    assert manage("harvest_health", "--any", env=env).returncode == 1, "a blocked replica anywhere fails --any"
    leader = manage("harvest_health", "--name", "replica-a", env=env)
    assert leader.returncode == 0 and leader.stdout.startswith("ok: replica-a is leader (0 records/s, 0 in flight)")
    assert leader.stdout.endswith("; 1 live replica(s) for replica 'replica-a'; 1 held, 2 parked\n")


def test_health_names_each_replica_with_the_shards_it_leads(database_url):
    """Two replicas of a 2-shard group, each leading one shard: the probe credits each with its own shard (it
    once named the first replica as leading both). The rows are written again before each probe, as live replicas
    keep writing theirs: eight probes on a loaded machine took longer than a row counts as live."""
    def live_rows() -> None:
        for replica, shard, host in (("replica-a", 1, "host-a"), ("replica-b", 0, "host-b")):
            status_row(replica, ReplicaState.STANDBY, shards=2, host=host)
            status_row(f"{replica}-s{shard}", ReplicaState.LEADER, leader_id=uuid.UUID(int=shard + 1), shard=shard,
                       shards=2, host=host, throughput=10.0)

    both = ("replica-a leads shard(s) 1 of 2 (10 records/s, 0 in flight); "
            "replica-b leads shard(s) 0 of 2 (10 records/s, 0 in flight)")
    for flags in (["--any"], ["--any", "--require-leader"]):
        live_rows()
        result = manage("harvest_health", *flags, env={"DATABASE_URL": database_url})
        assert result.returncode == 0 and result.stdout.startswith(f"ok: {both}, seen "), result.stdout
    for name, host, own in (("replica-a", "host-a", "replica-a leads shard(s) 1 of 2"),
                            ("replica-b", "host-b", "replica-b leads shard(s) 0 of 2")):
        for flags in (["--name", name], ["--host", host]):
            live_rows()
            result = manage("harvest_health", *flags, env={"DATABASE_URL": database_url})
            assert result.returncode == 0 and result.stdout.startswith(f"ok: {own} ("), (flags, result.stdout)
            assert ("replica-a" in result.stdout) != ("replica-b" in result.stdout), result.stdout


def test_health_reports_an_unreachable_database_in_one_line():
    result = manage("harvest_health", "--any", env={"DATABASE_URL": "postgres://outbox:outbox@127.0.0.1:1/outbox"})
    assert result.returncode == 1
    assert result.stdout.startswith("unhealthy: cannot read harvester status:") and not result.stderr.strip()


def test_a_sharded_replicas_metrics_and_health_name_its_shards(database_url, bootstrap_servers, new_topic, tmp_path):
    topic = new_topic("metrics-shards")
    port = free_port()
    env = replica_env(database_url, bootstrap_servers, f"test-leader-{uuid.uuid4().hex[:8]}")
    name = f"probe-{uuid.uuid4().hex[:6]}"
    replica = Replica(name, env, tmp_path, ["--shards", "2", "--metrics-port", str(port), "--metrics-address",
                                           "127.0.0.1", "--heartbeat-timeout", "2", "--status-interval", "0.5"])
    replica_labels = f'name="{name}",outbox="outbox"'
    try:
        wait_until(lambda: replica.state() == "standby", 60, "the replica's own row (in the group)")
        wait_until(lambda: scrape(port).get(f"outbox_shards_led{{{replica_labels}}}") == 2.0, 60,
                   "the replica to lead both shards")
        with transaction.atomic():
            stash_many([{"topic": topic, "key": f"k{i % 10}", "value": str(i)} for i in range(200)])
        wait_until(lambda: outbox_count(database_url) == 0, 60, "the outbox to drain")
        metrics = wait_until(lambda: (m := scrape(port)) and sum(
            m.get(f'outbox_records_published_total{{{replica_labels},shard="{s}"}}', 0) for s in "01") == 200 and m,
            30, "both shards' published_total to add up to 200")
        assert metrics[f"outbox_shards{{{replica_labels}}}"] == 2.0
        assert metrics["outbox_mark_seconds_count"] > 0 and metrics["outbox_purge_seconds_count"] > 0
        for shard in "01":
            assert metrics[f'outbox_leader_state{{{replica_labels},shard="{shard}",state="leader"}}'] == 1.0
            assert metrics[f'outbox_records_published_total{{{replica_labels},shard="{shard}"}}'] > 0
        healthy = wait_until(lambda: (r := manage("harvest_health", "--name", name, "--require-leader", env=env))
                             .returncode == 0 and "leads shard(s) 0, 1 of 2" in r.stdout and r, 30,
                             "the probe to name the replica's shards")
        assert healthy.stdout.startswith(f"ok: {name} leads shard(s) 0, 1 of 2"), healthy.stdout
    finally:
        replica.signal(signal.SIGTERM)
        assert replica.wait() == 0


def _families(scraped: dict[str, float]) -> set[str]:
    """The metric families of a scrape: series names without labels and Prometheus's own suffixes."""
    names = {series.partition("{")[0] for series in scraped}
    return {re.sub(r"_(total|created|bucket|sum|count)$", "", name) for name in names}


def _documented() -> set[str]:
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        import metric_reference
    finally:
        sys.path.pop(0)
    return {name for path in metric_reference.EXPORTERS.values() for name, *_ in metric_reference.metrics(path)}
