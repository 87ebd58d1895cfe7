"""Many outboxes in one process against real Postgres and Kafka (outbox/harvest/outboxes.py, notify_hub.py,
tenants.py, outbox/many.py): tenant schemas, django-tenants style, each with an outbox table.

Two processes' worth of harvesters (ManyHarvester, in this process) harvest five tenant schemas: every
record arrives, per key in order; each outbox is woken by its own NOTIFY through one LISTEN session per
harvester (not a session, nor a poll, per outbox); a schema created while they run is picked up.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from django.core.management import call_command
from django.test import override_settings
from psycopg import sql

from outbox import conf, many
from outbox.harvest import discovery
from outbox.harvest.config import Limits
from outbox.harvest.contract import ReplicaState
from outbox.harvest.harvester import State
from outbox.harvest.outboxes import ManyHarvester
from tests.support.commands import manage
from tests.support.harness import assert_complete_and_ordered, read_topic, wait_until
from tests.support.services import drop_database
from tests.support.tenants import PREFIX, TenantWriter, create_tenant

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

def sessions(database_url: str, purpose: str, name: str) -> int:
    """The harvester's sessions of one purpose in this database (store.connect names them in application_name)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
                            "AND datname = current_database()", [f"outbox-harvest-{purpose} {name}"]).fetchone()[0]


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


def history_samples(database_url: str, names: list[str]) -> dict[str, int]:
    """The history samples of these harvesters' engines: name -> the highest published count sampled."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        return dict(conn.execute("SELECT name, max(published) FROM outbox_harvester_history "
                                 "WHERE split_part(name, '/', 1) = ANY(%s) GROUP BY name", [names]).fetchall())


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
        harvesters = [ManyHarvester(many.discoverer(conf.harvest_config(name=name), entries, conf.build()[1]),
                                    name=name, rescan_interval=1.0) for name in names]
    labels = {f"tenants.{schema}" for schema in schemas}
    for harvester in harvesters:
        harvester.start()
    try:
        configs = [config for harvester in harvesters for config in harvester.outboxes.values()]
        assert sorted(config.table for config in configs) == sorted([f"{schema}.outbox" for schema in schemas] * 2)
        assert all(config.limits == Limits(heartbeat_timeout=2.0, status_interval=0.5, history_interval=0.0,
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
        # One LISTEN session and one status session per harvester (per database), not one per outbox (a process
        # leading none holds no LISTEN session); each engine's status row says what it does.
        assert [sessions(database_url, "listen", name) for name in names] == [int(bool(h.leading)) for h in harvesters]
        assert [sessions(database_url, "status", name) for name in names] == [1, 1]
        # A fence session only where the engine leads: a standby holds none.
        assert [fence_sessions(database_url, name) for name in names] == [len(h.leading) for h in harvesters]
        wait_until(lambda: sum(row[2] for row in status_rows(database_url, names).values()) >= 300 * len(schemas),
                   10, "the status rows to count every record published")
        rows = status_rows(database_url, names)
        assert sorted(rows) == sorted(f"{name}/tenants.{schema}" for name in names for schema in schemas)
        assert sorted(row[0] for row in rows.values() if row[1] == "leader") == sorted(f"{schema}.outbox"
                                                                                      for schema in schemas)
        assert all(harvester.hubs.running[0].channels and harvester.hubs.running[0].received for harvester in harvesters
                   if harvester.leading)
        assert history_samples(database_url, names) == {}, "a tenant's outbox draws no charts"

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

        # A tenant dropped and created again within one rescan: another table (its oid names its NOTIFY channel
        # and fence), harvested by fresh engines, woken by its NOTIFYs.
        again = schemas[1]
        before = {id(harvester.engines[f"tenants.{again}"]) for harvester in harvesters}
        tenants.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(again)))
        create_tenant(tenants, again)
        wait_until(lambda: all(f"tenants.{again}" in h.engines and id(h.engines[f"tenants.{again}"]) not in before
                               for h in harvesters)
                   and f"tenants.{again}" in set(harvesters[0].leading) | set(harvesters[1].leading), 60,
                   "fresh engines for the table created again, one leading")
        topics_again = {again: new_topic("again")}
        writer = TenantWriter(database_url, topics_again, count=100)
        started = time.monotonic()
        writer.start()
        writer.join(timeout=60)
        assert writer.failure is None, writer.failure
        assert_complete_and_ordered(read_topic(bootstrap_servers, topics_again[again], expected=100, timeout=30),
                                    writer.ids[again])
        assert time.monotonic() - started < many.MANY_IDLE_POLL_INTERVAL, "woken by the new table's NOTIFY"
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


@pytest.fixture
def second_database(database_url: str, tmp_path) -> Iterator[str]:
    """A second database, migrated by `manage.py migrate` as a project's other database would be."""
    name = f"{psycopg.conninfo.conninfo_to_dict(database_url)['dbname']}_second"
    url = database_url.rsplit("/", 1)[0] + f"/{name}"

    drop_database(database_url, name)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    env = {**os.environ, "DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": "project.settings"}
    migrated = subprocess.run([sys.executable, str(ROOT / "manage.py"), "migrate", "--no-input"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    try:
        yield url
    finally:
        drop_database(database_url, name)


def test_tables_a_sharded_one_and_another_database_in_one_process(tenants, second_database, database_url,
                                                                   bootstrap_servers, new_topic, tmp_path):
    """OUTBOX["outboxes"]'s other kinds: two tables of one database (one sharded) and the outbox of another
    database, harvested by the same two processes: one LISTEN session per database and process, each
    database's status rows in its own status table, every record delivered in per-key order."""
    run = uuid.uuid4().hex[:8]
    plain, sharded = f"{PREFIX}{run}_plain", f"{PREFIX}{run}_sharded"
    for schema in (plain, sharded):
        create_tenant(tenants, schema)
    settings = {"base_kafka_config": {"bootstrap.servers": bootstrap_servers}, "heartbeat_timeout": 2.0,
                "status_interval": 0.5}
    entries = {"plain": {"table": f"{plain}.outbox"}, "sharded": {"table": f"{sharded}.outbox", "shards": 3},
               "other": {}}
    names = [f"mixed-a-{run}", f"mixed-b-{run}"]
    with override_settings(OUTBOX=settings):
        base_configs = [conf.harvest_config(name=name) for name in names]
        given = conf.build()[1]

    def discoverer(base):
        def discover():
            found = {label: discovery.outbox_config(base, label, entry, entry.get("table", "outbox"), given,
                                                     many.locate)
                     for label, entry in entries.items()}
            # The other database's entry, as `"database": "billing"` would name it (conf.dsn_for of the alias).
            other = found["other"]
            found["other"] = dataclasses.replace(other, dsn=psycopg.conninfo.make_conninfo(second_database),
                                                 leader_topic=f"{other.leader_topic}-second",
                                                 leader_group=f"{other.leader_group}-second")
            return found
        return discover

    harvesters = [ManyHarvester(discoverer(base), name=base.name, rescan_interval=5.0) for base in base_configs]
    for harvester in harvesters:
        harvester.start()
    try:
        wait_until(lambda: {"plain", "other"} <= set(harvesters[0].leading) | set(harvesters[1].leading)
                   and all(engine.state is State.RUNNING for h in harvesters for engine in h.engines.values()), 90,
                   "the plain outboxes to have a leader")
        topics = {"plain": new_topic("mixed-plain"), "sharded": new_topic("mixed-sharded"),
                  "other": new_topic("mixed-other")}
        writers = [TenantWriter(database_url, {plain: topics["plain"], sharded: topics["sharded"]}, count=300),
                   TenantWriter(second_database, {"public": topics["other"]}, count=300)]
        for writer in writers:
            writer.start()
        for writer in writers:
            writer.join(timeout=120)
            assert not writer.is_alive() and writer.failure is None, writer.failure
        for label, ids in (("plain", writers[0].ids[plain]), ("sharded", writers[0].ids[sharded]),
                           ("other", writers[1].ids["public"])):
            assert_complete_and_ordered(read_topic(bootstrap_servers, topics[label], expected=300, timeout=60), ids)
        # The sharded outbox's shards are spread over the two processes' engines.
        sharded_leaders = {h.name for h in harvesters if "sharded" in h.engines
                           and h.engines["sharded"].replica_state is ReplicaState.LEADER}
        assert sharded_leaders, "a process leads some of the sharded outbox's shards"
        # One LISTEN session per database and process where it leads something (a shard's engine too), whatever
        # the number of its outboxes there; none where it only stands by.
        def leads(harvester: ManyHarvester, labels: set[str]) -> bool:
            return any(engine.replica_state is ReplicaState.LEADER for label, engine in harvester.engines.items()
                       if label in labels)

        for url, labels in ((database_url, {"plain", "sharded"}), (second_database, {"other"})):
            assert [sessions(url, "listen", name) for name in names] == [int(leads(h, labels)) for h in harvesters]
        assert [len(h.hubs.running) for h in harvesters] == [leads(h, {"plain", "sharded"}) + leads(h, {"other"})
                                                          for h in harvesters]
        # Each database's status table holds the rows of the engines harvesting there.
        wait_until(lambda: {row[0] for row in status_rows(second_database, names).values()} == {"outbox"}
                   and len(status_rows(second_database, names)) == 2, 10, "the other database's status rows")
        here = status_rows(database_url, names)
        assert {f"{plain}.outbox", f"{sharded}.outbox"} <= {row[0] for row in here.values()}
        assert not any(row[0] == "outbox" for row in here.values())
        # A fixed entry's engines on the board write history samples (the dashboard's charts), its leader's
        # with the published count.
        samples = history_samples(database_url, names)
        assert {f"{name}/plain" for name in names} <= set(samples), samples
        wait_until(lambda: sum(history_samples(database_url, names).get(f"{name}/plain", 0) for name in names) >= 300,
                   30, "a sample counting the plain outbox's records")
        assert set(history_samples(second_database, names)) == {f"{name}/other" for name in names}
        # harvest_health reads the status rows of every database OUTBOX["outboxes"] names, as a user's settings
        # name the second one ("other": {"database": "second"}): the other database's engines are seen there.
        (tmp_path / "two_databases.py").write_text(
            "from project.settings import *  # noqa\n"
            f"DATABASES['second'] = {{**DATABASES['default'], 'NAME': {second_database.rsplit('/', 1)[1]!r}}}\n"
            f"OUTBOX = {{**OUTBOX, 'outboxes': {{'plain': {{'table': '{plain}.outbox'}}, "
            f"'sharded': {{'table': '{sharded}.outbox', 'shards': 3}}, 'other': {{'database': 'second'}}}}}}\n")
        env = {"DJANGO_SETTINGS_MODULE": "two_databases", "PYTHONPATH": f"{tmp_path}:{ROOT}",
               "DATABASE_URL": database_url}
        other_leader = next(f"{h.name}/other" for h in harvesters if "other" in h.leading)
        probe = manage("harvest_health", "--name", other_leader, "--require-leader", env=env)
        assert probe.returncode == 0 and probe.stdout.startswith(f"ok: {other_leader} is leader ("), \
            probe.stdout + probe.stderr
        probe = manage("harvest_health", "--any", env=env)
        assert probe.returncode == 0 and "; 2 live replica(s) for any replica;" in probe.stdout, \
            "two processes, however many engines' rows: " + probe.stdout + probe.stderr
        # The dashboard lists the other database's outbox among the other outboxes, named with its database.
        shown = ("from outbox.console.dashboard import overview; found = overview(); "
                 "print([(o.table, len(o.leaders)) for o in found.others]); print([a.kind for a in found.warnings])")
        probe = manage("shell", "-c", shown, env=env)
        assert "(\"outbox (database 'second')\", 1)" in probe.stdout and "elsewhere" not in probe.stdout, \
            probe.stdout + probe.stderr
        # A database it cannot read is named, and judges nothing: the replicas whose outboxes are here stay healthy
        # (a liveness probe must not restart them), one there is not seen; an alarm on the dashboard, no traceback.
        (tmp_path / "two_databases.py").write_text((tmp_path / "two_databases.py").read_text().replace(
            second_database.rsplit("/", 1)[1], "outbox_no_such_database"))
        probe = manage("harvest_health", "--any", env=env)
        assert probe.returncode == 0 and "; cannot read the status rows in database 'second': " in probe.stdout, \
            probe.stdout + probe.stderr
        probe = manage("harvest_health", "--name", other_leader, env=env)
        assert probe.returncode == 1 and "never seen" in probe.stdout and "database 'second'" in probe.stdout, \
            probe.stdout + probe.stderr
        probe = manage("shell", "-c", shown, env=env)
        assert probe.returncode == 0 and "'elsewhere'" in probe.stdout, probe.stdout + probe.stderr
    finally:
        for harvester in harvesters:
            harvester.stop()
        for harvester in harvesters:
            assert harvester.wait(timeout=60), "stopped within 60 s"
