"""The harvester, harvest_health, the dashboard and outbox_audit on a Kafka cluster behind TLS and SASL/SCRAM.

`bin/services up --brokers 3 --secure` makes the cluster, its CA and its users, and writes the
client settings to `.services/kafka-3-secure/client.env`. Everything here is configured the way
a user would: those environment variables, read by the example project into OUTBOX (no code).
A wrong password or an untrusted certificate must be one line and a non-zero exit; and no
password, key or certificate content may appear in any output the tests can see.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.db import transaction
from django.test import Client

from outbox import stash_many
from outbox.models import HarvesterStatus
from tests.support.commands import manage
from tests.support.harness import (
    Replica,
    assert_complete_and_ordered,
    outbox_count,
    read_topic,
    replica_env,
    wait_until,
)
from tests.support.kafka_cluster import Cluster

# Kafka behind TLS and SASL: the same on any PostgreSQL server (not in make test-postgres18)
pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True), pytest.mark.postgres_agnostic]

DASHBOARD = "/admin/outbox/dashboard/"
WRONG_PASSWORD = f"wrong-{uuid.uuid4().hex}"


class Secrets:
    """Every secret of the secure cluster, to look for in whatever the tests saw."""

    def __init__(self, cluster: Cluster) -> None:
        credentials = dict(line.split("=", 1) for line in (cluster.home / "credentials").read_text().split())
        self.words = {f"password of {user}": password for user, password in credentials.items()}
        self.words["the wrong password tried"] = WRONG_PASSWORD
        tls = cluster.home / "tls"
        for name in ("ca.key", "broker.key", "ca.pem", "broker.crt"):
            body = [line for line in (tls / name).read_text().splitlines() if line and not line.startswith("-----")]
            for number, line in enumerate(body):
                self.words[f"line {number + 1} of {name}"] = line

    def assert_absent(self, text: str, where: str) -> None:
        found = [what for what, secret in self.words.items() if secret in text]
        assert not found, f"{where} shows {', '.join(found)}"


@pytest.fixture
def secrets(secure_cluster: Cluster) -> Secrets:
    return Secrets(secure_cluster)


def environment(cluster: Cluster, database_url: str, leader_topic: str, **overrides: str) -> dict[str, str]:
    """What an operator sets: DATABASE_URL and the cluster's client.env, nothing else (the log at INFO)."""
    return {**replica_env(database_url, cluster.bootstrap_servers, leader_topic), **cluster.environment(),
            **overrides}


def untrusted_ca(tmp_path: Path) -> Path:
    """A CA of our own that never signed the brokers' certificates."""
    key, cert = tmp_path / "other-ca.key", tmp_path / "other-ca.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=other CA",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert


@pytest.mark.slow
def test_harvest_health_dashboard_and_audit_on_the_secure_cluster(secure_cluster, secrets, database_url, tmp_path):
    """Slow: a harvester, the probe, the dashboard and a Spark audit, each a
    process of its own, against three brokers behind TLS and SASL."""
    leader_topic = f"secure-leader-{uuid.uuid4().hex[:8]}"
    topic = secure_cluster.create_topic("secure-records", partitions=3)
    env = environment(secure_cluster, database_url, leader_topic, LOG_LEVEL="DEBUG")  # the most a log can say
    seen: dict[str, str] = {}

    printed = manage("harvest", "--print-config", env=env)
    assert printed.returncode == 0, printed.stderr
    kafka = json.loads(printed.stdout)["base_kafka_config"]
    assert kafka["security.protocol"] == "SASL_SSL" and kafka["sasl.mechanism"] == "SCRAM-SHA-512"
    assert kafka["sasl.password"] == "***"
    seen["harvest --print-config"] = printed.stdout + printed.stderr

    name = f"secure-{uuid.uuid4().hex[:6]}"
    replica = Replica(name, env, tmp_path, ["--status-interval", "0.5", "--heartbeat-timeout", "2"])
    try:
        wait_until(replica.is_leading, 60, "the replica to lead over SASL_SSL")
        with transaction.atomic():
            ids = stash_many([{"topic": topic, "key": f"k{i % 7}", "value": f"v{i}"} for i in range(500)])
        wait_until(lambda: outbox_count(database_url) == 0, 60, "the outbox to drain")

        # Heartbeats go acks=all to three brokers: one slow round trip may fence for a moment.
        health = wait_until(lambda: (h := manage("harvest_health", "--name", name, "--require-leader", env=env))
                            .returncode == 0 and h, 30, "the health check to see the leader")
        assert health.stdout.startswith("ok: "), health.stdout + health.stderr
        seen["harvest_health"] = health.stdout + health.stderr

        rows = wait_until(lambda: list(HarvesterStatus.objects.filter(name=name, state="leader").values()), 30,
                          "the status row to say leader")
        seen["the status row"] = repr(rows)

        client = Client()
        client.force_login(User.objects.create_superuser("secure-admin", "a@example.com", "pw"))
        page = client.get(DASHBOARD)
        assert page.status_code == 200 and name in page.content.decode()
        seen["the dashboard"] = page.content.decode()

        ledger = tmp_path / "ledger.txt"
        ledger.write_text("".join(f"{i}\n" for i in ids))
        audit = manage("outbox_audit", "--topics", topic, "--out", str(tmp_path / "audit"), "--ledger", str(ledger),
                       env=env, timeout=300)
        assert audit.returncode == 0, audit.stdout + audit.stderr[-3000:]
        report = json.loads((tmp_path / "audit" / "report.json").read_text())
        assert (report["distinct_ids"], report["reversals"], report["missing"]) == (500, 0, 0), report
        seen["outbox_audit's output"] = audit.stdout + audit.stderr
        seen["report.json"] = json.dumps(report)
    finally:
        replica.signal(signal.SIGTERM)
        code = replica.wait(timeout=60)
    assert code == 0, replica.log()[-3000:]
    assert_complete_and_ordered(read_topic(secure_cluster.bootstrap_servers, topic, expected=500,
                                           config=secure_cluster.client_config()), ids)
    seen["the harvester's log (DEBUG)"] = replica.log()
    status = secure_cluster.services("status", *secure_cluster.flags)
    assert "3 of 3 node(s) running" in status.stdout and "SASL_SSL" in status.stdout, status.stdout
    seen["bin/services status"] = status.stdout + status.stderr
    for node in secure_cluster.nodes.values():
        seen[f"broker {node.number}'s log"] = node.log_file.read_text(errors="replace")
    for where, text in seen.items():
        secrets.assert_absent(text, where)
    with pytest.raises(AssertionError, match="password of outbox"):
        secrets.assert_absent(f"a canary: {secure_cluster.password}", "the canary")  # the search can fail


@pytest.mark.parametrize("fault", ["wrong password", "untrusted certificate"])
def test_a_bad_login_or_certificate_is_one_line_and_non_zero(fault, secure_cluster, secrets, database_url, tmp_path):
    if fault == "wrong password":
        bad, expected = {"KAFKA_SASL_PASSWORD": WRONG_PASSWORD}, r"refused the login: SASL authentication error"
    else:
        bad, expected = {"KAFKA_SSL_CA_LOCATION": str(untrusted_ca(tmp_path))}, r"TLS with Kafka at .* failed: .*" \
                                                                                   r"certificate verify failed"
    env = environment(secure_cluster, database_url, f"secure-leader-{uuid.uuid4().hex[:8]}", **bad)

    harvest = manage("harvest", env=env, timeout=60)
    lines = harvest.stderr.strip().splitlines()
    assert harvest.returncode == 1 and len(lines) == 1, harvest.stderr
    assert re.match(rf"CommandError: (Kafka at|TLS with Kafka at) {re.escape(secure_cluster.bootstrap_servers)}",
                    lines[0]) and re.search(expected, lines[0]), lines[0]

    audit = manage("outbox_audit", "--topics", "anything", "--out", str(tmp_path / "audit"), env=env, timeout=120)
    audit_lines = audit.stderr.strip().splitlines()
    assert audit.returncode == 2 and len(audit_lines) == 1, audit.stderr
    assert audit_lines[0].startswith("outbox_audit: error: ") and re.search(expected, audit_lines[0]), audit_lines

    for where, text in {"harvest's error": harvest.stdout + harvest.stderr,
                        "outbox_audit's error": audit.stdout + audit.stderr}.items():
        secrets.assert_absent(text, where)
