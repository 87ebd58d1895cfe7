"""An unrelated transaction left open: harvesting goes on, and the operator is told who holds the horizon.

A REPEATABLE READ transaction in another session holds the database's horizon back, so no dead row
can be vacuumed; before marks became reads, every mark walked the dead rows above a watermark that
transaction held in place, and the harvester stalled. Now nothing waits for it: the records written
meanwhile are published in order, and the dashboard, harvest_health and the metrics name the session.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from django.contrib.auth.models import User
from django.test import Client, override_settings

from outbox import horizon
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.harvester import Harvester
from tests.support.harness import Generator, assert_complete_and_ordered, outbox_count, read_topic, wait_until

# The horizon is the server's, not a database's: another test holding a transaction open would be named instead.
pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def superuser_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", None))
    return client


def test_an_old_transaction_holds_nothing_back_and_is_named(database_url, bootstrap_servers, new_topic,
                                                            superuser_client):
    topic = new_topic("old-transaction")
    leader = f"test-leader-{uuid.uuid4().hex[:8]}"
    config = HarvestConfig(dsn=database_url, base_kafka_config={"bootstrap.servers": bootstrap_servers},
                           leader_topic=leader, leader_group=leader, name="in-process",
                           limits=Limits(heartbeat_timeout=2.0, min_metrics_interval=1.0))
    old = psycopg.connect(database_url, application_name="forgotten-report")
    old.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    old.execute("SELECT count(*) FROM pg_class").fetchone()  # the snapshot is taken: the horizon stops here
    harvester = Harvester(config)
    generator = Generator(topic, limit=6000)
    harvester.start()
    try:
        wait_until(lambda: harvester.is_leader, 30, "the harvester to lead")
        generator.start()
        wait_until(lambda: len(generator.ids) >= 6000, 180, "6000 records stashed behind the old transaction")
        stashed = generator.stop()
        # A generous liveness bound: it drained in well under a second here with or without the old transaction.
        wait_until(lambda: outbox_count(database_url) == 0, 60, "the outbox to drain while the transaction is open")
        assert old.info.transaction_status is psycopg.pq.TransactionStatus.INTRANS, "the transaction is still open"
        from django.conf import settings

        with override_settings(OUTBOX={**settings.OUTBOX, "horizon_warn_after": 0.5}):
            time.sleep(0.6)
            found = horizon.read()
            assert found.held_back and found.holder.kind == "session"
            assert found.holder.pid == old.info.backend_pid and found.holder.name == "forgotten-report"
            assert found.dead_rows >= 0
            page = superuser_client.get("/admin/outbox/dashboard/").content.decode()
            assert 'id="outbox-warning-horizon"' in page and f"session {old.info.backend_pid}" in page
            assert "forgotten-report" in page
    finally:
        harvester.stop()
        harvester.wait(timeout=30)
        old.close()
    audit = read_topic(bootstrap_servers, topic, expected=len(stashed))
    assert_complete_and_ordered(audit, stashed, strict=False)


def test_harvest_health_names_the_holder_on_a_second_line(database_url, services):
    old = psycopg.connect(database_url, application_name="idle-in-transaction-psql")
    old.execute("BEGIN")
    old.execute("SELECT txid_current()").fetchone()
    try:
        env = {"DATABASE_URL": database_url, "KAFKA_BOOTSTRAP_SERVERS": services.bootstrap_servers,
               "OUTBOX_HORIZON_WARN_AFTER": "0.1", "PATH": "/usr/bin:/bin"}
        time.sleep(0.3)
        result = subprocess.run([sys.executable, str(ROOT / "manage.py"), "harvest_health", "--any"],
                                capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
        lines = result.stdout.strip().splitlines()
        assert len(lines) == 2, result.stdout + result.stderr
        assert lines[1].startswith("warning: The database's horizon is held back by session ")
        assert "idle-in-transaction-psql" in lines[1] and "idle in transaction" in lines[1]
    finally:
        old.close()
