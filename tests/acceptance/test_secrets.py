"""Secrets never printed (docs/kafka.md, "What is secret"): a distinct marker in each kind of secret,
then every command that prints configuration, a harvester and a tracker at the highest verbosity, the
admin pages and the metrics; no marker may appear in any of it."""

from __future__ import annotations

import signal
import textwrap
import uuid
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.db import transaction
from django.test import override_settings

from outbox import stash
from outbox.kafka.redaction import LIBRDKAFKA_SENSITIVE
from tests.support.commands import manage
from tests.support.harness import Process, Replica, outbox_count, replica_env, wait_until
from tests.support.metrics import scrape
from tests.support.services import free_port

# what the commands print and log: the same on any PostgreSQL server (not in make test-postgres18)
pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True), pytest.mark.postgres_agnostic]

RUN = uuid.uuid4().hex[:8]
#: librdkafka's sensitive properties (ssl_key is set through the C API only), each with its own marker.
KAFKA_SECRETS = {name: f"MARKER-{name}-{RUN}" for name in sorted(LIBRDKAFKA_SENSITIVE - {"ssl_key"})}
#: Unknown to librdkafka, secret by name: only --print-config and check can take them (librdkafka refuses them).
NAMED_SECRETS = {name: f"MARKER-{name}-{RUN}" for name in ("my.api.token", "vault.credentials", "custom.cert.pem",
                                                          "signing.key", "sasl.jaas.config")}
SSLPASSWORD = f"MARKER-sslpassword-{RUN}"
DSN_PASSWORD = f"MARKER-dsn-password-{RUN}"
ALL_MARKERS = [*KAFKA_SECRETS.values(), *NAMED_SECRETS.values(), SSLPASSWORD, DSN_PASSWORD]


def settings_module(tmp_path: Path, name: str, extra_kafka: dict[str, str]) -> dict[str, str]:
    """A settings module with the markers planted, and the environment that selects it."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(f"""
        from project.settings import *  # noqa: F403
        OUTBOX = {{**OUTBOX, "base_kafka_config": {{**OUTBOX["base_kafka_config"], **{extra_kafka!r}}},
                  "producer_kafka_config": {{"ssl.keystore.password": {KAFKA_SECRETS["ssl.keystore.password"]!r}}}}}
        DATABASES["default"]["OPTIONS"] = {{"sslpassword": {SSLPASSWORD!r}}}
    """))
    return {"DJANGO_SETTINGS_MODULE": name, "PYTHONPATH": f"{tmp_path}:{Path(__file__).resolve().parents[2]}",
            "LOG_LEVEL": "DEBUG"}


def assert_no_marker(where: str, text: str) -> None:
    found = [marker for marker in ALL_MARKERS if marker in text]
    assert not found, f"{where} shows {found}"


def test_commands_that_print_configuration_show_no_secret(tmp_path, database_url):
    kafka = {**KAFKA_SECRETS, **NAMED_SECRETS}
    env = settings_module(tmp_path, "secret_settings", kafka)
    with_password = {**env, "DATABASE_URL": database_url.replace("outbox:outbox@", f"outbox:{DSN_PASSWORD}@")
                     + f"?sslpassword={SSLPASSWORD}"}
    runs = {
        "harvest --print-config": manage("harvest", "--print-config", "--skip-checks", env=with_password),
        "outbox_redeliver --print-config": manage("outbox_redeliver", "--print-config", "--skip-checks",
                                                  env=with_password),
        "check": manage("check", env=with_password),
        "harvest (refused settings)": manage("harvest", "-v", "3", "--skip-checks", env=with_password),
        "harvest_health": manage("harvest_health", "--any", env=with_password),
    }
    for what, result in runs.items():
        assert_no_marker(what, result.stdout + result.stderr)
    printed = runs["harvest --print-config"]
    assert '"sasl.password": "***"' in printed.stdout and '"my.api.token": "***"' in printed.stdout
    assert printed.returncode == 1 and "E013" not in printed.stdout, "printed, then refused: librdkafka's verdict"
    assert "is refused by librdkafka" in printed.stderr


def test_a_harvester_and_a_tracker_at_the_highest_verbosity_and_the_admin_and_metrics_show_no_secret(
        tmp_path, database_url, bootstrap_servers, new_topic, client):
    env = {**replica_env(database_url, bootstrap_servers, f"test-leader-{uuid.uuid4().hex[:8]}"),
           **settings_module(tmp_path, "secret_run_settings", {**KAFKA_SECRETS, "debug": "generic,conf"})}
    topic = new_topic("secrets")
    port = free_port()
    harvester = Replica("secret-harvester", env, tmp_path, ["-v", "3", "--metrics-port", str(port),
                                                            "--metrics-address", "127.0.0.1"])
    tracker = Process("secret-tracker", "outbox_redeliver", ["-v", "3"], env, tmp_path)
    try:
        wait_until(harvester.is_leading, 60, "the harvester to lead")
        with transaction.atomic():
            stash(topic, "k", "published with every secret planted")
        wait_until(lambda: outbox_count(database_url) == 0, 30, "the record to be published")
        assert_no_marker("/metrics", "\n".join(f"{k} {v}" for k, v in scrape(port).items()))
        User.objects.create_superuser("admin", "a@example.com", "pw")
        client.login(username="admin", password="pw")
        kafka = {**KAFKA_SECRETS, "bootstrap.servers": bootstrap_servers}
        with override_settings(OUTBOX={"base_kafka_config": kafka, "queues": {"topic": "secret-q"}}):
            for page in ("/admin/outbox/dashboard/", "/admin/outbox/outboxrecord/", "/admin/outbox_queue/queue/",
                         "/admin/outbox_queue/deadletter/"):
                response = client.get(page)
                assert response.status_code == 200, page
                assert_no_marker(page, response.content.decode())
    finally:
        for process in (harvester, tracker):
            process.signal(signal.SIGTERM)
        codes = [harvester.wait(), tracker.wait()]
    logs = {process.name: process.log() for process in (harvester, tracker)}
    for name, log in logs.items():
        assert_no_marker(f"{name}'s log", log)
    assert "DEBUG" in logs["secret-harvester"] and "Leading with leader id" in logs["secret-harvester"]
    assert "CONF" in logs["secret-harvester"], "librdkafka's own configuration dump was on"
    assert codes == [0, 0], logs
