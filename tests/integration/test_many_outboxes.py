"""Many outboxes in one process against real Postgres and Kafka (outbox/harvest/outboxes.py, notify_hub.py,
tenants.py, outbox/many.py): tenant schemas, django-tenants style, each with an outbox table.

Two processes' worth of harvesters (ManyHarvester, in this process) harvest five tenant schemas: every
record arrives, per key in order; each outbox is woken by its own NOTIFY through one LISTEN session per
harvester (not a session, nor a poll, per outbox); a schema created while they run is picked up.
"""

from __future__ import annotations

import io
import json
import time
import uuid

import psycopg
import pytest
from django.core.management import call_command
from django.test import override_settings
from psycopg import sql

from outbox import conf, many
from outbox.harvest.config import Limits
from outbox.harvest.outboxes import ManyHarvester
from tests.support.harness import assert_complete_and_ordered, read_topic, wait_until
from tests.support.tenants import PREFIX, TenantWriter, create_tenant

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

def sessions(database_url: str, purpose: str, name: str) -> int:
    """The harvester's sessions of one purpose (store.connect names them in application_name)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                            [f"outbox-harvest-{purpose} {name}"]).fetchone()[0]


def fence_sessions(database_url: str, name: str) -> int:
    """The fence sessions of this harvester's engines (named `outbox-harvest-fence <group tag> <name>/<label>`)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
                            [f"outbox-harvest-fence % {name}/%"]).fetchone()[0]


def status_rows(database_url: str, names: list[str]) -> dict[str, tuple[str, str, int]]:
    """The status rows of these harvesters' engines seen in the last 5 s: name -> (table, state, published)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute("SELECT name, harvested_table, state, published FROM outbox_harvester "
                            "WHERE split_part(name, '/', 1) = ANY(%s) AND last_seen > now() - interval '5 seconds'",
                            [names]).fetchall()
    return {name: (table, state, published) for name, table, state, published in rows}


def test_two_processes_harvest_every_tenant_schema_and_pick_up_a_new_one(tenants, database_url, bootstrap_servers,
                                                                         new_topic):
    run = uuid.uuid4().hex[:8]
    schemas = [f"{PREFIX}{run}_{i}" for i in range(5)]
    for schema in schemas:
        create_tenant(tenants, schema)
    topics = {schema: new_topic(schema.replace("_", "-")) for schema in schemas}
    settings = {"base_kafka_config": {"bootstrap.servers": bootstrap_servers}, "heartbeat_timeout": 2.0,
                "status_interval": 0.5}
    names = [f"many-a-{run}", f"many-b-{run}"]
    with override_settings(OUTBOX=settings):
        entries = many.selected_entries(None, tenant_schemas=True, table="outbox", exclude_schemas=["public"])
        harvesters = [ManyHarvester(many.discoverer(conf.harvest_config(name=name), entries, conf.given_limits()),
                                    name=name, rescan_interval=1.0) for name in names]
    labels = {f"tenants.{schema}" for schema in schemas}
    for harvester in harvesters:
        harvester.start()
    try:
        configs = [config for harvester in harvesters for config in harvester.outboxes.values()]
        assert sorted(config.table for config in configs) == sorted([f"{schema}.outbox" for schema in schemas] * 2)
        assert all(config.limits == Limits(heartbeat_timeout=2.0, status_interval=0.5,
                                           idle_poll_interval=many.MANY_IDLE_POLL_INTERVAL) for config in configs)
        wait_until(lambda: set(harvesters[0].leading) | set(harvesters[1].leading) == labels, 90,
                   "every tenant's outbox to have a leader")
        assert not set(harvesters[0].leading) & set(harvesters[1].leading), "one leader per outbox"
        # The outboxes are idle and their safety-net poll is a minute away: what is written now is found
        # because its NOTIFY woke its outbox's engine.
        writer = TenantWriter(database_url, topics, count=300)
        started = time.monotonic()
        writer.start()
        writer.join(timeout=120)
        assert not writer.is_alive() and writer.failure is None, writer.failure
        for schema in schemas:
            audit = read_topic(bootstrap_servers, topics[schema], expected=300, timeout=30)
            assert_complete_and_ordered(audit, writer.ids[schema])
        assert time.monotonic() - started < many.MANY_IDLE_POLL_INTERVAL, "woken by NOTIFY, not by the poll"
        # One LISTEN session and one status session per harvester (per database), not one per outbox; each
        # engine's status row says what it does.
        assert [sessions(database_url, "listen", name) for name in names] == [1, 1]
        assert [sessions(database_url, "status", name) for name in names] == [1, 1]
        # A fence session only where the engine leads: a standby holds none.
        assert [fence_sessions(database_url, name) for name in names] == [len(h.leading) for h in harvesters]
        wait_until(lambda: sum(row[2] for row in status_rows(database_url, names).values()) >= 300 * len(schemas),
                   10, "the status rows to count every record published")
        rows = status_rows(database_url, names)
        assert sorted(rows) == sorted(f"{name}/tenants.{schema}" for name in names for schema in schemas)
        assert sorted(row[0] for row in rows.values() if row[1] == "leader") == sorted(f"{schema}.outbox"
                                                                                      for schema in schemas)
        assert all(harvester.hubs.hubs[0].channels and harvester.hubs.hubs[0].received for harvester in harvesters)

        # harvest_health --name <process> speaks for the process's outboxes' engines.
        health = io.StringIO()
        call_command("harvest_health", "--name", names[0], stdout=health)
        assert health.getvalue().startswith("ok: "), health.getvalue()

        # A tenant created while they run is harvested within a rescan or so.
        late = f"{PREFIX}{run}_late"
        create_tenant(tenants, late)
        wait_until(lambda: f"tenants.{late}" in set(harvesters[0].leading) | set(harvesters[1].leading), 60,
                   "the new tenant's outbox to have a leader")
        topics_late = {late: new_topic("late")}
        writer = TenantWriter(database_url, topics_late, count=100)
        writer.start()
        writer.join(timeout=60)
        assert writer.failure is None, writer.failure
        assert_complete_and_ordered(read_topic(bootstrap_servers, topics_late[late], expected=100, timeout=30),
                                    writer.ids[late])

        # A tenant dropped: its engines stop, the others go on.
        gone = schemas[0]
        tenants.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(gone)))
        wait_until(lambda: all(f"tenants.{gone}" not in harvester.engines for harvester in harvesters), 60,
                   "the dropped tenant's engines to stop")
        assert all(len(harvester.engines) == 5 for harvester in harvesters)
    finally:
        for harvester in harvesters:
            harvester.stop()
        for harvester in harvesters:
            assert harvester.wait(timeout=60), "stopped within 60 s"
    with psycopg.connect(database_url, autocommit=True) as conn:
        states = conn.execute("SELECT DISTINCT state FROM outbox_harvester WHERE split_part(name, '/', 1) = ANY(%s)",
                              [names]).fetchall()
    assert states == [("stopped",)], "each engine's row says it stopped"


def test_print_config_lists_each_tenants_outbox(tenants, database_url):
    run = uuid.uuid4().hex[:8]
    for i in range(2):
        create_tenant(tenants, f"{PREFIX}{run}_{i}")
    out = io.StringIO()
    call_command("harvest", "--tenant-schemas", "--exclude-schema", "public", "--name", "printer", "--print-config",
                 stdout=out)
    found = json.loads(out.getvalue())
    assert sorted(found) == [f"tenants.{PREFIX}{run}_0", f"tenants.{PREFIX}{run}_1"]
    first = found[f"tenants.{PREFIX}{run}_0"]
    assert first["table"] == f"{PREFIX}{run}_0.outbox" and first["name"] == f"printer/tenants.{PREFIX}{run}_0"
    assert first["leader_group"] != found[f"tenants.{PREFIX}{run}_1"]["leader_group"]
    assert "password=outbox" not in first["dsn"], "the password masked"
