"""`harvest --metrics-port` and `harvest_health`, run as an operator (and Kubernetes) would."""

from __future__ import annotations

import signal
import socket
import urllib.request
import uuid
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from outbox import stash_many
from outbox.models import HarvesterStatus
from tests.acceptance.test_harvest_command import manage
from tests.integration.harness import Replica, outbox_count, replica_env, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("outbox_"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


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
        with transaction.atomic():
            stash_many([{"topic": topic, "key": f"k{i % 5}", "value": str(i)} for i in range(200)])
        wait_until(lambda: outbox_count(database_url) == 0, 60, "the outbox to drain")
        metrics = wait_until(lambda: (m := scrape(port)).get(f'outbox_records_published_total{{name="{name}"}}')
                             == 200 and m, 30, "published_total to reach 200")
        assert metrics[f'outbox_leader_state{{name="{name}",state="leader"}}'] == 1.0
        assert metrics[f'outbox_in_flight_records{{name="{name}"}}'] == 0.0
        assert metrics["outbox_mark_seconds_count"] > 0 and metrics["outbox_purge_seconds_count"] > 0
        assert f'outbox_backlog_records{{name="{name}"}}' in metrics

        healthy = manage("harvest_health", "--name", name, "--require-leader", env=env)
        assert healthy.returncode == 0, healthy.stdout + healthy.stderr
        assert healthy.stdout.startswith(f"ok: {name} is leader")
        assert manage("harvest_health", "--any", env=env).returncode == 0
    finally:
        replica.signal(signal.SIGTERM)
        assert replica.wait() == 0
    gone = manage("harvest_health", "--name", name, env=env)
    assert gone.returncode == 1 and gone.stdout.startswith(f"unhealthy: no live harvester for replica '{name}'")
    assert len(gone.stdout.strip().splitlines()) == 1


def test_health_fails_for_a_replica_not_seen_recently(services):
    now = timezone.now()
    HarvesterStatus.objects.create(name="stale", host="h", pid=1, state="leader", since=now, started=now,
                                   last_seen=now - timedelta(minutes=5), harvested_table="outbox", leader_topic="t",
                                   leader_group="g")
    from django.core.management import call_command

    with pytest.raises(SystemExit) as exit_info:
        call_command("harvest_health", "--name", "stale")
    assert exit_info.value.code == 1


def test_health_reports_an_unreachable_database_in_one_line():
    result = manage("harvest_health", "--any", env={"DATABASE_URL": "postgres://outbox:outbox@127.0.0.1:1/outbox"})
    assert result.returncode == 1
    assert result.stdout.startswith("unhealthy: cannot read harvester status:") and not result.stderr.strip()
