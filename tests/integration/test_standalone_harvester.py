"""The stand-alone harvester (outbox-harvest) as an application in another language meets it: a database of its
own, a table goharvest's README makes (or the DDL `outbox-harvest schema` prints), rows written by plain SQL, and
replicas that import no Django (tests/support/harness.py: STANDALONE) killed under load."""

from __future__ import annotations

import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from outbox.harvest import schema
from tests.support.fresh_project import user_env
from tests.support.harness import (
    GOHARVEST_DDL,
    STANDALONE,
    Generator,
    Replica,
    assert_complete_and_ordered,
    read_topic,
    wait_until,
)
from tests.support.services import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
GOHARVEST_TABLE = GOHARVEST_DDL.format(table="outbox")
#: goharvest's README, "Writing outbox records", for a batch of rows.
INSERT = ("INSERT INTO outbox (create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, "
          "kafka_header_values) VALUES (now(), %s, %s, %s, '{}', '{}')")


class SqlWriter(Generator):
    """An application writing the table with plain SQL (goharvest's INSERT), one transaction of `batch` rows
    after another."""

    def __init__(self, url: str, topic: str, *, limit: int | None = None, table: str = "outbox") -> None:
        super().__init__(topic, keys=8, batch=10, pause=0.005, limit=limit)
        self.url = url
        self.insert = INSERT.replace("INSERT INTO outbox", f"INSERT INTO {table}") + " RETURNING id"
        self.conn: psycopg.Connection | None = None

    def write(self, records: list[dict[str, Any]]) -> list[int]:
        self.conn = self.conn or psycopg.connect(self.url)
        with self.conn.transaction(), self.conn.cursor() as cursor:
            return [cursor.execute(self.insert, (r["topic"], r["key"], r["value"])).fetchone()[0] for r in records]

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


@pytest.fixture
def database(services):
    """A database of its own, with nothing in it."""
    name = f"standalone_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(services.database_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield services.database_url_for(name)
    services.drop_database(name)


def standalone_env(url: str, bootstrap: str) -> dict[str, str]:
    return {**user_env(), "DATABASE_URL": url, "KAFKA_BOOTSTRAP_SERVERS": bootstrap, "PYTHONPATH": str(ROOT)}


def outbox_rows(url: str, table: str = "outbox") -> int:
    with psycopg.connect(url) as conn:
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def test_the_schema_is_what_the_migrations_make(db):
    """outbox/harvest/schema.sql is sqlmigrate's output for every migration (python -m tests.support.schema_ddl
    writes it again after a new migration)."""
    from tests.support.schema_ddl import render

    assert schema.SQL.read_text() == render(), "schema.sql is stale: run python -m tests.support.schema_ddl"


def test_a_goharvest_table_written_by_plain_sql_is_harvested(database, bootstrap_servers, new_topic, tmp_path):
    """goharvest's own table, none of this project's: no status rows, no parking, no NOTIFY trigger (the
    harvester polls), and every record published in key order."""
    with psycopg.connect(database) as conn:
        conn.execute(GOHARVEST_TABLE)
    topic = new_topic("standalone-goharvest")
    writer = SqlWriter(database, topic, limit=400)
    writer.start()
    harvester = Replica("goharvest-table", standalone_env(database, bootstrap_servers), tmp_path,
                        ["--heartbeat-timeout", "2"], program=STANDALONE)
    try:
        wait_until(lambda: len(writer.ids) >= 400, 60, "400 rows written")
        written = writer.stop()
        wait_until(lambda: outbox_rows(database) == 0, 60, "the table to drain")
    finally:
        harvester.signal(signal.SIGTERM)
    assert harvester.wait(timeout=60) == 0, harvester.log()
    assert_complete_and_ordered(read_topic(bootstrap_servers, topic, expected=len(written)), written, strict=False)
    assert "has no NOTIFY trigger" in harvester.log()


def test_the_table_of_every_tenant_schema_is_harvested(database, bootstrap_servers, new_topic, tmp_path):
    """`--tenant-schemas`: an engine per schema holding a goharvest table written by plain SQL, each in key order to
    its own topic; the excluded schema is left alone, and a schema created while running is picked up."""
    with psycopg.connect(database) as conn:
        for tenant in ("acme", "globex", "skipped"):
            conn.execute(f"CREATE SCHEMA {tenant}")
            conn.execute(GOHARVEST_TABLE.replace("TABLE outbox", f"TABLE {tenant}.outbox"))
        conn.execute(INSERT.replace("outbox", "skipped.outbox", 1), ("untouched", "k", "v"))
    topics = {tenant: new_topic(f"standalone-{tenant}") for tenant in ("acme", "globex", "initech")}
    writers = {tenant: SqlWriter(database, topics[tenant], limit=200, table=f"{tenant}.outbox")
               for tenant in ("acme", "globex")}
    config = tmp_path / "harvest.toml"
    config.write_text("discover_interval = 1\n")
    harvester = Replica("tenants", standalone_env(database, bootstrap_servers), tmp_path,
                        ["--config", str(config), "--tenant-schemas", "--exclude-schema", "skipped",
                         "--heartbeat-timeout", "2", "--idle-poll-interval", "0.5"], program=STANDALONE)
    try:
        for writer in writers.values():
            writer.start()
        wait_until(lambda: all(len(w.ids) >= 200 for w in writers.values()), 60, "200 rows written in each schema")
        written = {tenant: writer.stop() for tenant, writer in writers.items()}
        with psycopg.connect(database) as conn:  # a tenant arrives while the harvester runs
            conn.execute("CREATE SCHEMA initech")
            conn.execute(GOHARVEST_TABLE.replace("TABLE outbox", "TABLE initech.outbox"))
        writers["initech"] = SqlWriter(database, topics["initech"], limit=50, table="initech.outbox")
        writers["initech"].start()
        wait_until(lambda: len(writers["initech"].ids) >= 50, 60, "50 rows written in the new schema")
        written["initech"] = writers["initech"].stop()
        wait_until(lambda: all(outbox_rows(database, f"{t}.outbox") == 0 for t in written), 90,
                   "every tenant's table to drain")
    finally:
        harvester.signal(signal.SIGTERM)
    assert harvester.wait(timeout=60) == 0, harvester.log()
    for tenant, ids in written.items():
        assert_complete_and_ordered(read_topic(bootstrap_servers, topics[tenant], expected=len(ids)), ids)
    assert outbox_rows(database, "skipped.outbox") == 1, "the excluded schema's table is left alone"
    assert f"{harvester.name}/tenants.initech" in harvester.log()


def test_the_schema_is_applied_whole_or_not_at_all(database, tmp_path):
    """A goharvest table is refused without --since (and takes the rest with it); a failing migration leaves
    nothing of the others behind."""
    env = standalone_env(database, "127.0.0.1:9")

    def apply(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*STANDALONE, "schema", "--apply", *args], env=env, capture_output=True, text=True,
                              timeout=60)

    def tables() -> set[str]:
        with psycopg.connect(database) as conn:
            return {row[0] for row in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}

    with psycopg.connect(database) as conn:
        conn.execute(GOHARVEST_TABLE)
        conn.execute("CREATE TABLE outbox_harvester_shards (id int)")  # in the way of the last migration
    refused = apply()
    assert refused.returncode == 1 and "already has table outbox (goharvest's?)" in refused.stderr, refused.stderr
    assert "--since 0001_initial" in refused.stderr
    failed = apply("--since", "0001_initial")
    assert failed.returncode == 1 and "the schema was not applied (nothing was changed)" in failed.stderr
    assert tables() == {"outbox", "outbox_harvester_shards"}
    with psycopg.connect(database) as conn:
        conn.execute("DROP TABLE outbox_harvester_shards")
    applied = apply("--since", "0001_initial")
    assert applied.returncode == 0 and applied.stdout.startswith("applied 8 migration(s): 0002_status_and_failures")
    assert tables() == {"outbox", "outbox_harvester", "outbox_harvester_history", "outbox_dead_letter",
                        "outbox_harvester_shards"}


def test_replicas_without_django_are_killed_under_load_and_lose_nothing(database, bootstrap_servers, new_topic,
                                                                        tmp_path):
    """The schema applied by `outbox-harvest schema --apply`, three stand-alone replicas deriving their group from
    the database, the leader SIGKILLed twice while an application writes: nothing lost, no key reversed."""
    env = standalone_env(database, bootstrap_servers)
    applied = subprocess.run([*STANDALONE, "schema", "--apply"], env=env, capture_output=True, text=True, timeout=60)
    assert applied.returncode == 0 and applied.stdout.startswith("applied 9 migration(s)"), applied
    topic = new_topic("standalone-kills")
    args = ["--heartbeat-timeout", "2", "--min-metrics-interval", "1"]
    replicas = [Replica(f"standalone-{i}-{uuid.uuid4().hex[:4]}", env, tmp_path, args, program=STANDALONE)
                for i in range(3)]
    writer = SqlWriter(database, topic)
    writer.start()
    try:
        for kill in range(1, 3):
            leader = wait_until(lambda: next((r for r in replicas if r.is_leading()), None), 60, "a leader")
            assert sum(r.is_leading() for r in replicas) == 1, "one group: one leader"
            wait_until(lambda kill=kill: len(writer.ids) > 300 * kill, 60, "rows written under this leader")
            leader.kill()
            replicas.remove(leader)
            replicas.append(Replica(f"standalone-new-{uuid.uuid4().hex[:4]}", env, tmp_path, args,
                                    program=STANDALONE))
        wait_until(lambda: next((r for r in replicas if r.is_leading()), None), 60, "a leader after the kills")
        written = writer.stop()
        wait_until(lambda: outbox_rows(database) == 0, 120, "the table to drain")
    finally:
        writer.halt.set()
        for replica in replicas:
            replica.signal(signal.SIGTERM)
    for replica in replicas:
        assert replica.wait(timeout=60) == 0, replica.log()
    assert_complete_and_ordered(read_topic(bootstrap_servers, topic, expected=len(written)), written, strict=False)


def test_the_number_of_shards_is_changed_without_django(database, bootstrap_servers, new_topic, tmp_path):
    """A table harvested unsharded, then in 3 shards, with no `manage.py`: a replica of the new number is refused
    before the group is resharded (in one line naming `outbox-harvest reshard`, and building no index); `reshard` is
    refused while a leader runs, then gives the leader topic a partition per shard and builds the index; the three
    shards then publish every row in key order."""
    env = standalone_env(database, bootstrap_servers)

    def harvest(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*STANDALONE, *args], env=env, capture_output=True, text=True, timeout=120)

    assert harvest("schema", "--apply").returncode == 0
    leader_topic = f"standalone-reshard-{uuid.uuid4().hex[:8]}"
    flags = ["--leader-topic", leader_topic, "--heartbeat-timeout", "2"]
    one = Replica(f"reshard-one-{uuid.uuid4().hex[:4]}", env, tmp_path, flags, program=STANDALONE)
    try:
        wait_until(one.is_leading, 60, "the unsharded replica to lead")
        refused = harvest("reshard", "--shards", "3", "--leader-topic", leader_topic)
        assert refused.returncode == 1, refused
        assert refused.stderr.startswith("outbox-harvest: a harvester leads on 'outbox' (outbox-harvest-fence"), refused
        assert len(refused.stderr.splitlines()) == 1, refused.stderr
    finally:
        one.signal(signal.SIGTERM)
    assert one.wait(timeout=60) == 0, one.log()

    early = harvest(*flags, "--shards", "3")
    assert early.returncode == 1 and "run manage.py outbox_reshard --shards 3, or outbox-harvest reshard --shards 3" \
        in early.stderr, early.stderr
    with psycopg.connect(database) as conn:
        assert conn.execute("SELECT to_regclass('outbox_shard3_idx')").fetchone()[0] is None, "no index built"

    done = harvest("reshard", "--shards", "3", "--leader-topic", leader_topic)
    assert done.returncode == 0, done
    assert done.stdout.startswith(f"'outbox' is now harvested in 3 shard(s): leader topic {leader_topic!r} grown "
                                  f"from 1 to 3 partition(s); index outbox_shard3_idx ready."), done.stdout
    topic = new_topic("standalone-reshard")
    writer = SqlWriter(database, topic, limit=300)
    three = Replica(f"reshard-three-{uuid.uuid4().hex[:4]}", env, tmp_path, [*flags, "--shards", "3"],
                    program=STANDALONE)
    writer.start()
    try:
        wait_until(lambda: len(writer.ids) >= 300, 60, "300 rows written")
        written = writer.stop()
        wait_until(lambda: outbox_rows(database) == 0, 60, "the three shards to drain the table")
    finally:
        writer.halt.set()
        three.signal(signal.SIGTERM)
    assert three.wait(timeout=60) == 0, three.log()
    assert_complete_and_ordered(read_topic(bootstrap_servers, topic, expected=len(written)), written, strict=False)


def test_the_outbox_tables_of_two_schemas_reached_by_search_path_are_both_harvested(database, bootstrap_servers,
                                                                                     new_topic, tmp_path):
    """Two applications in two schemas of one database, each with its own `outbox` table and the harvester's
    connection's search_path set to its schema: each derives a leader group of its own and both are harvested
    (with one group for the two, one of them stood by for ever)."""
    billing = f"{database}?options=-csearch_path%3Dbilling"
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA billing")
    for url in (database, billing):
        applied = subprocess.run([*STANDALONE, "schema", "--apply"], env=standalone_env(url, bootstrap_servers),
                                 capture_output=True, text=True, timeout=60)
        assert applied.returncode == 0, applied
    topics = {url: new_topic("standalone-schemas") for url in (database, billing)}
    writers = [SqlWriter(url, topic, limit=100) for url, topic in topics.items()]
    replicas = [Replica(f"schemas-{n}-{uuid.uuid4().hex[:4]}", standalone_env(url, bootstrap_servers), tmp_path,
                        ["--heartbeat-timeout", "2"], program=STANDALONE) for n, url in enumerate(topics)]
    for writer in writers:
        writer.start()
    try:
        wait_until(lambda: all(len(writer.ids) >= 100 for writer in writers), 60, "100 rows in each table")
        written = [writer.stop() for writer in writers]
        wait_until(lambda: outbox_rows(database, "public.outbox") + outbox_rows(database, "billing.outbox") == 0, 60,
                   "both tables to drain")
    finally:
        for writer in writers:
            writer.halt.set()
        for replica in replicas:
            replica.signal(signal.SIGTERM)
    for replica in replicas:
        assert replica.wait(timeout=60) == 0, replica.log()
    for topic, ids in zip(topics.values(), written, strict=True):
        assert_complete_and_ordered(read_topic(bootstrap_servers, topic, expected=len(ids)), ids, strict=False)


def test_a_search_path_the_settings_do_not_show_is_warned_of(database, bootstrap_servers, tmp_path):
    """The table found in schema billing through PGOPTIONS (as through the role's or the database's search_path),
    which the derived leader group cannot see: the harvester says so at start, once, naming what to set."""
    billing = f"{database}?options=-csearch_path%3Dbilling"
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA billing")
    env = standalone_env(billing, bootstrap_servers)
    assert subprocess.run([*STANDALONE, "schema", "--apply"], env=env, capture_output=True, timeout=60).returncode == 0
    env = {**standalone_env(database, bootstrap_servers), "PGOPTIONS": "-c search_path=billing"}
    harvester = Replica(f"pgoptions-{uuid.uuid4().hex[:4]}", env, tmp_path, ["--heartbeat-timeout", "2", "--shards",
                                                                             "2"], program=STANDALONE)
    said = "Table 'outbox' is billing.outbox here (the session's search_path), but its leader group outbox-leader."
    try:
        wait_until(lambda: "Leading" in harvester.log() and said in harvester.log(), 60, "the warning, and leading")
    finally:
        harvester.signal(signal.SIGTERM)
    assert harvester.wait(timeout=60) == 0, harvester.log()
    assert harvester.log().count(said) == 1, "once, not once per shard"
    assert "set table = 'billing.outbox' (or leader_topic and leader_group)" in harvester.log()


def test_an_unreachable_database_or_broker_is_one_line(database, tmp_path):
    env = {**user_env(), "PYTHONPATH": str(ROOT), "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:9"}
    parts = urlsplit(database)
    gone = urlunsplit(parts._replace(netloc=f"{parts.netloc.rpartition(':')[0]}:{free_port()}"))
    cases = ((gone, "outbox-harvest: cannot connect to Postgres at "),
             (database, "outbox-harvest: table 'outbox' does not exist at "),
             (database, "outbox-harvest: Kafka is unreachable at 127.0.0.1:9: "))
    for number, (url, expected) in enumerate(cases):
        if number == 2:
            with psycopg.connect(database) as conn:
                conn.execute(GOHARVEST_TABLE)
        done = subprocess.run([*STANDALONE, "--heartbeat-timeout", "1"], env={**env, "DATABASE_URL": url},
                              capture_output=True, text=True, timeout=120)
        lines = [line for line in done.stderr.splitlines() if line.startswith("outbox-harvest: ")]
        assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith(expected), done.stderr
        assert ":outbox@" not in done.stderr and "password=" not in done.stderr


def test_the_probe_reads_the_status_rows_of_every_database_the_file_names(database, services, bootstrap_servers,
                                                                          tmp_path):
    """`outbox-harvest health --config` with an `[outboxes.NAME]` on another database (its `dsn`): that outbox's
    engines write their status rows there, and the probe reads them, named with their database. A database it
    cannot read is named on its line and judges nothing (a liveness probe)."""
    other = f"{database.rsplit('/', 1)[1]}_billing"
    with psycopg.connect(services.database_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{other}"')
    billing = services.database_url_for(other)
    env = standalone_env(database, bootstrap_servers)
    try:
        for url in (database, billing):
            applied = subprocess.run([*STANDALONE, "schema", "--apply"], env={**env, "DATABASE_URL": url},
                                     capture_output=True, text=True, timeout=60)
            assert applied.returncode == 0, applied.stderr
        config = tmp_path / "outboxes.toml"
        config.write_text(f'[outboxes.shop]\n[outboxes.billing]\ndsn = "{billing}"\n')
        harvester = Replica("two-databases", env, tmp_path, ["--config", str(config), "--heartbeat-timeout", "2"],
                            program=STANDALONE)

        def probe(*args: str, file: Path = config) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*STANDALONE, "health", "--config", str(file), *args], env=env,
                                  capture_output=True, text=True, timeout=60)

        try:
            for label in ("shop", "billing"):  # --require-leader asks for any leader: the line says whose
                wait_until(lambda label=label: probe("--name", f"two-databases/{label}", "--require-leader").stdout
                           .startswith(f"ok: two-databases/{label} is leader ("), 60,
                           f"the {label} outbox's engine to lead, as the probe reads its database")
            both = probe("--any", "--require-leader")
            assert both.returncode == 0 and "; cannot read" not in both.stdout, both.stdout + both.stderr
            gone = tmp_path / "gone.toml"
            gone.write_text(config.read_text().replace(f"/{other}", "/outbox_no_such_database"))
            unread = probe("--any", file=gone)
            assert unread.returncode == 0 and "; cannot read the status rows in database 'outbox_no_such_database': " \
                in unread.stdout, unread.stdout + unread.stderr
            unseen = probe("--name", "two-databases/billing", file=gone)
            assert unseen.returncode == 1 and "never seen" in unseen.stdout, unseen.stdout + unseen.stderr
            assert ":outbox@" not in unread.stdout + unseen.stdout, "no password shown"
        finally:
            harvester.signal(signal.SIGTERM)
        assert harvester.wait(timeout=60) == 0, harvester.log()
    finally:
        services.drop_database(other)


@pytest.mark.slow
def test_the_wheel_installs_the_command(wheel_venv, database, bootstrap_servers, new_topic, tmp_path):
    """`outbox-harvest` as pip installs it: the schema from the wheel, rows written by plain SQL, published.
    Slow: the first test of its worker to take the wheel builds it."""
    command = wheel_venv.parent / "outbox-harvest"
    env = {**user_env(), "DATABASE_URL": database, "KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers}
    applied = subprocess.run([command, "schema", "--apply"], env=env, capture_output=True, text=True, timeout=60,
                             cwd=tmp_path)
    assert applied.returncode == 0, applied.stderr
    topic = new_topic("standalone-wheel")
    with psycopg.connect(database) as conn:
        ids = [conn.execute(INSERT + " RETURNING id", (topic, f"key-{i % 3}", f"v{i}")).fetchone()[0]
               for i in range(30)]
    process = subprocess.Popen([command, "--heartbeat-timeout", "2"], env=env, cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def probe(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([command, "health", *args], env=env, capture_output=True, text=True, timeout=60)

    try:
        audit = read_topic(bootstrap_servers, topic, expected=len(ids), timeout=60)
        healthy = wait_until(lambda: (done := probe("--require-leader")).returncode == 0 and done, 30,
                             "a healthy probe")
        assert healthy.stdout.startswith("ok: ") and " is leader " in healthy.stdout, healthy.stdout
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[0]
    assert process.returncode == 0, output
    assert_complete_and_ordered(audit, ids, strict=True)
    assert "Stopped (published 30, failed 0)" in output
    stopped = probe()
    assert stopped.returncode == 1 and stopped.stdout.startswith("unhealthy: no live harvester for replicas on host ")
    assert "stopped cleanly" in stopped.stdout, stopped.stdout
