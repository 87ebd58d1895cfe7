"""Issue 19's target for many outboxes, as a user runs it: 50 tenant schemas (django-tenants style, an
outbox table each) harvested by two `manage.py harvest --tenant-schemas` processes. At rest the two
together run at most 5 statements a second on the database (a NOTIFY wakes the outbox that was written;
nothing polls each outbox); then every record written to every tenant arrives, per key in order.
"""

from __future__ import annotations

import time
import uuid

import psycopg
import pytest
from psycopg import sql

from tests.support.harness import Process, assert_complete_and_ordered, replica_env, wait_until
from tests.support.tenants import PREFIX, TenantWriter, create_tenant, read_tenants

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

TENANTS = 50
#: The issue's budget for the two processes together, with every outbox idle (statements per second).
IDLE_BUDGET = 5.0
#: This test's own statements carry this comment and are left out of the count.
OWN = "test_many_tenants"


def leading_tables(database_url: str, tables: list[str]) -> int:
    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute(f"/* {OWN} */ SELECT count(DISTINCT harvested_table) FROM outbox_harvester "
                            "WHERE state = 'leader' AND last_seen > now() - interval '10 seconds' "
                            "AND harvested_table = ANY(%s)", [tables]).fetchone()[0]


def statements_run(database_url: str) -> int:
    """Statements this database ran so far (pg_stat_statements), this test's own left out."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute(f"/* {OWN} */ SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements "
                            "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
                            "AND query NOT LIKE %s", [f"%{OWN}%"]).fetchone()[0]


def explain_missing(database_url: str, schema: str, missing: set[int], processes: list[Process]) -> str:
    """Where records that never arrived are: still in their outbox (and how), and what the harvesters warned."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute(sql.SQL(f"/* {OWN} */ SELECT * FROM {{}}.outbox WHERE id = ANY(%s) ORDER BY id").format(
            sql.Identifier(schema)), [sorted(missing)]).fetchall()
        left = conn.execute(sql.SQL(f"/* {OWN} */ SELECT count(*) FROM {{}}.outbox").format(
            sql.Identifier(schema))).fetchone()[0]
    warnings = [line for process in processes for line in process.log().splitlines()
                if schema in line or "WARNING" in line or "ERROR" in line or "Traceback" in line][-40:]
    return (f"{len(missing)} record(s) of {schema} never published, e.g. {sorted(missing)[:5]}; {left} row(s) left "
            f"in its outbox; the missing ones there: {rows!r}; the harvesters said: " + "\n".join(warnings))


@pytest.mark.slow
def test_two_processes_harvest_fifty_tenants_idle_for_under_five_statements_a_second(
        tenants, statement_stats, database_url, bootstrap_servers, new_topic, tmp_path):
    """Slow: fifty tenant schemas made and led, then 30 s of rest counted."""
    run = uuid.uuid4().hex[:6]
    schemas = [f"{PREFIX}{run}_{i:02d}" for i in range(TENANTS)]
    for schema in schemas:
        create_tenant(tenants, schema)
    tables = [f"{schema}.outbox" for schema in schemas]
    env = replica_env(database_url, bootstrap_servers, f"unused-{run}")  # each outbox derives its own
    env["LOG_LEVEL"] = "WARNING"
    processes = [Process(f"tenants-{run}-{i}", "harvest", ["--tenant-schemas", "--exclude-schema", "public"],
                         env, tmp_path) for i in range(2)]
    try:
        def all_led() -> bool:
            dead = [process.log()[-2000:] for process in processes if process.process.poll() is not None]
            assert not dead, f"a harvester exited: {dead[0]}"
            return leading_tables(database_url, tables) == TENANTS

        wait_until(all_led, 240, f"each of the {TENANTS} tenants' outboxes to have a leader", interval=1.0)
        time.sleep(10)  # the last engines' start-up statements done
        before, began = statements_run(database_url), time.monotonic()
        time.sleep(30)
        rate = (statements_run(database_url) - before) / (time.monotonic() - began)
        print(f"{TENANTS} idle tenant outboxes, 2 processes: {rate:.2f} statements/s")
        assert rate <= IDLE_BUDGET, f"{rate:.2f} statements/s at rest (the budget is {IDLE_BUDGET})"

        topic = new_topic(f"tenants-{run}", partitions=8)
        writer = TenantWriter(database_url, dict.fromkeys(schemas, topic), count=40, keys=4)
        writer.start()
        writer.join(timeout=180)
        assert not writer.is_alive() and writer.failure is None, writer.failure
        audits = read_tenants(bootstrap_servers, topic, writer.ids, timeout=120)
        assert sorted(audits) == sorted(schemas)
        for schema in schemas:  # ids repeat across tenants (an identity each): a record is its schema and id
            missing = set(writer.ids[schema]) - audits[schema].ids
            assert not missing, explain_missing(database_url, schema, missing, processes)
            assert_complete_and_ordered(audits[schema], writer.ids[schema])
            assert len(audits[schema].by_key) == 4
    finally:
        for process in processes:
            process.signal(15)
        for process in processes:
            try:
                process.wait(timeout=90)
            except Exception:
                process.kill()
