"""What harvesting costs the database, against a real Postgres: every statement of the engine told as its kind in
pg_stat_statements, a running harvester's samples carrying its round trips and the server's time, and the
dashboard showing them per kind."""

from __future__ import annotations

import contextlib
import logging
import re
import uuid
from datetime import timedelta

import psycopg
import pytest
from django.contrib.auth.models import User
from django.db import transaction
from django.test import Client
from django.utils import timezone
from prometheus_client import CollectorRegistry, generate_latest

from outbox import stash_many
from outbox.harvest import dbtime
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.contract import Record, ReplicaState
from outbox.harvest.harvester import Harvester
from outbox.harvest.status import HistorySampler, StatusSnapshot, identity
from outbox.harvest.status_board import StatusBoards, writer_statements
from outbox.harvest.store import PostgresStore
from outbox.metrics import HarvesterCollector, PrometheusInstruments
from outbox.models import HarvesterSample, OutboxRecord
from tests.support.harness import wait_until
from tests.support.history_rows import samples

# What statements cost is the server's (pg_stat_statements, the server's CPU): other workers' harvesters would count.
pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.django_db(transaction=True)]

def config(database_url: str, bootstrap: str = "unused:9092", **limits: float) -> HarvestConfig:
    leader = f"test-leader-{uuid.uuid4().hex[:8]}"
    return HarvestConfig(dsn=database_url, base_kafka_config={"bootstrap.servers": bootstrap}, leader_topic=leader,
                         leader_group=leader, name=f"cost-{uuid.uuid4().hex[:6]}", history_retention=86400,
                         limits=Limits(heartbeat_timeout=2.0, **limits))


def sampler(found: HarvestConfig) -> HistorySampler:
    """An engine's history sampler, as its status writer (status_board.py) makes it."""
    return HistorySampler(found, identity(found, timezone.now()), writer_statements(found.status_table))


def test_each_statement_of_the_engine_counts_as_its_kind_in_pg_stat_statements(statement_stats):
    found = config(statement_stats)
    reporter = sampler(found)
    patterns = dbtime.server_patterns(["outbox", "outbox_harvester", "outbox_harvester_history"])
    conn = psycopg.connect(statement_stats, autocommit=True)
    store = PostgresStore.open(statement_stats, "outbox", name=found.name, group=found.leader_group,
                               dead_letter_table="outbox_dead_letter", status_table="outbox_harvester")
    try:
        with transaction.atomic():
            ids = stash_many([{"topic": "cost", "key": f"k{i}", "value": "v"} for i in range(3)])
        # Each read learns the texts (the reporter does so every ten minutes, and reads by query id between).
        texts = dbtime.ServerTime(reporter._server_time.kinds, patterns, learn_interval=0)
        before = texts.read(conn)
        assert store.take_fence() is None
        records, _ = store.mark(100, 0, ((ids[0], ids[0]),))
        assert [r.id for r in records if r.id in ids] == sorted([*ids, ids[0]]), "the gap's row, and the mark's"
        store.check_held([ids[0]])
        version = store.hold(ids[0], "too large")
        assert store.reset([ids[1]], ["timed out"])[0] == 1
        assert store.purge([ids[2]])[0] == 1
        assert store.purge([ids[1]], read_fence=False) == (1, True), "deleted, the fence not read (counts as held)"
        held = next(r for r in records if r.id == ids[0])
        assert store.park(Record(held.id, held.create_time, held.topic, held.key, held.value, version=version),
                          "too large", 3, "test", None)
        store.release_fence()
        # Something of another kind naming pg_locks, which the filter lets through: not the harvester's.
        conn.execute("SELECT count(*) FROM pg_locks WHERE granted")
        after = texts.read(conn)
        # Between reads of the texts, by query id: the same figures.
        by_id = dbtime.ServerTime(reporter._server_time.kinds, patterns, learn_interval=3600)
        learnt = by_id.read(conn)
        assert store.purge([ids[0]]) == (0, False), "the row was parked; the fence released"
        again = by_id.read(conn)
    finally:
        store.close()
        conn.close()
    calls = {kind: after[kind][0] - before.get(kind, (0, 0.0, 0))[0] for kind in after}
    assert calls == {"mark": 1, "gaps": 1, "writers": 1, "check_held": 1, "hold": 1, "reset": 1, "purge": 2,
                     "park": 1, "fence": 2, "status": 1}, "the status kind counts the read before"
    was = before.get("mark", (0, 0.0, 0))
    assert after["mark"][1] > was[1] and after["mark"][2] - was[2] == 3, "the mark's time and rows"
    assert {kind: again[kind][0] - learnt[kind][0] for kind in again} == {
        **dict.fromkeys(learnt, 0), "purge": 1, "status": 1}


def test_a_leader_samples_its_round_trips_and_the_servers_time_and_the_dashboard_shows_them(
        statement_stats, bootstrap_servers, new_topic):
    topic = new_topic("cost")
    registry = CollectorRegistry()
    harvester = Harvester(config(statement_stats, bootstrap_servers, status_interval=0.1, history_interval=0.2),
                          instruments=PrometheusInstruments(registry))
    registry.register(HarvesterCollector(harvester))
    harvester.start()
    name = harvester.config.name

    def leading_sample() -> HarvesterSample | None:
        return HarvesterSample.objects.filter(name=name, db_statements__isnull=False).order_by("at").first()

    try:
        first = wait_until(leading_sample, 30, "the leader's first sample with the server's time")
        # An id taken and rolled back: a gap below the rows, so marks look it up and read the outbox's
        # writers (a mark without gaps does not read them).
        with contextlib.suppress(RolledBack), transaction.atomic():
            stash_many([{"topic": topic, "key": "gone", "value": "rolled back"}])
            raise RolledBack
        with transaction.atomic():
            stash_many([{"topic": topic, "key": f"k{i % 7}", "value": str(i)} for i in range(200)])
        wait_until(lambda: not OutboxRecord.objects.exists(), 30, "the outbox to be drained")

        def sampled() -> HarvesterSample | None:
            last = HarvesterSample.objects.filter(name=name).order_by("-at").first()
            if not (last and last.published == 200 and last.db_statements):
                return None
            # The mark after the 200 rows looks the gap up, with the writers (at the next NOTIFY or idle poll).
            return last if writers(last) > writers(first) else None

        def writers(sample: HarvesterSample) -> int:
            return sample.db_statements.get("writers", (0,))[0] if sample.db_statements else 0

        # The lookup ran after the leader's first read of the texts, which it reads again 10 s on.
        sample = wait_until(sampled, 40, "a sample with the 200 records, the gap's lookup and the server's time")
        assert harvester.database_statements is not None and harvester.round_trips["purge"][2] == 200
        metrics = scraped(registry)
    finally:
        harvester.stop()
        harvester.wait(timeout=30)
    trips, server = sample.db_round_trips, sample.db_statements
    assert first.published == 0
    assert {"fence", "mark", "purge"} <= set(trips) and trips["purge"][2] == 200 and trips["purge"][1] > 0
    assert {"mark", "writers", "purge", "fence", "status"} <= set(server)
    assert server["purge"][0] >= trips["purge"][0] and server["mark"][0] >= trips["mark"][0]
    assert all(seconds >= 0 for _, seconds, _ in server.values())
    # Prometheus: this replica's round trips, and the server's time as the leader last read it.
    assert metrics['outbox_database_round_trips_total{statement="purge"}'] >= 1
    assert metrics['outbox_database_seconds_total{statement="purge"}'] > 0
    assert metrics['outbox_database_round_trips_total{statement="mark"}'] >= 1
    served = f'outbox_database_server_seconds_total{{name="{name}",outbox="outbox",statement="mark"}}'
    assert metrics[served] > 0
    assert metrics[f'outbox_database_server_calls_total{{name="{name}",outbox="outbox",statement="purge"}}'] \
        >= trips["purge"][0]
    # The dashboard reads 20-second buckets over an hour: the run's first and last samples, as if a minute apart.
    HarvesterSample.objects.filter(name=name).exclude(pk__in=[first.pk, sample.pk]).delete()
    HarvesterSample.objects.filter(pk=first.pk).update(at=timezone.now() - timedelta(seconds=60))
    page = dashboard()
    section = re.search(r'<div class="outbox-section" id="database-cost".*?</div>\s*</div>', page, re.S).group(0)
    assert "the harvesters published 200 records; the database spent" in section
    assert 'data-title="Database time by statement"' in section
    assert 'data-title="Round trips by statement, time waited"' in section
    kinds = re.findall(r'<tr class="cost-kind" data-kind="([a-z_]+)">', section)
    assert {"mark", "writers", "purge", "status"} <= set(kinds), "the fence was taken before the span"


class RolledBack(Exception):
    pass


def scraped(registry: CollectorRegistry) -> dict[str, float]:
    """The registry's outbox_database_* samples, as Prometheus reads them."""
    values = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("outbox_database"):
            series, _, value = line.rpartition(" ")
            values[series] = float(value)
    return values


def dashboard() -> str:
    client = Client()
    client.force_login(User.objects.get_or_create(username="cost-root", is_staff=True, is_superuser=True)[0])
    return client.get("/admin/outbox/dashboard/").content.decode()


def test_without_pg_stat_statements_the_reporter_says_so_once_and_samples_round_trips_only(database_url, caplog):
    class NoView:
        broken = False
        statements: list[str] = []

        def execute(self, statement: str, *args: object) -> psycopg.Cursor:
            self.statements.append(statement)
            raise psycopg.errors.ObjectNotInPrerequisiteState(
                "pg_stat_statements must be loaded via shared_preload_libraries")

    reporter = sampler(config(database_url))
    conn = NoView()
    with caplog.at_level(logging.INFO, logger="outbox.harvest"):
        assert reporter._read_statements(conn) is None
        assert reporter._read_statements(conn) is None
    assert len(conn.statements) == 1, "not asked again"
    said = [r.getMessage() for r in caplog.records if "pg_stat_statements" in r.getMessage()]
    assert said == ["The database's time per statement is not recorded (the round trips are): pg_stat_statements: "
                    "pg_stat_statements must be loaded via shared_preload_libraries"]


def test_the_dashboard_explains_what_is_missing_without_the_servers_figures(database_url):
    samples("replica-a", leading_from=60, minutes=10, rate=100.0,
            round_trips={"mark": (10, 0.001), "purge": (100, 0.005)})
    page = dashboard()
    assert "needs pg_stat_statements in this database" in page
    assert 'data-title="Database time by statement"' not in page
    round_trips = re.search(r'data-title="Round trips by statement, time waited">(.*?)</figure>', page,
                            re.S).group(1)
    assert "purge: 5.0 ms/s" in round_trips and "mark: 1.0 ms/s" in round_trips
    assert re.findall(r'data-kind="([a-z_]+)"', page) == ["purge", "mark"]


def test_a_standby_reads_no_server_figures(statement_stats):
    snapshot = StatusSnapshot(state=ReplicaState.STANDBY, leader_id=None, since=timezone.now(), in_flight=0, queued=0,
                              in_flight_keys=[], in_flight_key_count=0, held=[], blocked_by=None, throughput=0.0,
                              published=0, failed=0, round_trips={"fence": (1, 0.001, 0)})
    found = config(statement_stats, status_interval=0.05, history_interval=0.05)
    reporter = StatusBoards().reporter(found, lambda: snapshot, lambda _: None)
    assert reporter is not None
    reporter.start()
    try:
        sample = wait_until(lambda: HarvesterSample.objects.filter(name=found.name).first(), 10, "a sample")
    finally:
        reporter.close()
    assert sample.db_round_trips == {"fence": [1, 0.001, 0]} and sample.db_statements is None
    assert reporter.statements is None


def test_a_purge_sets_its_commit_for_its_own_transaction_only(database_url):
    """cmd.Purge.durable: a purge nothing needs on disk commits with synchronous_commit off for its own
    transaction (contract.PURGE_COMMIT; a crash may undo it: tests/integration/test_database_crash.py shows it),
    a durable one with the session's setting; neither leaves the setting on the session, where a pooler in
    transaction mode would hand it to the application's transactions."""
    store = PostgresStore.open(database_url, "outbox", name="t", group="g")

    def setting() -> str:
        assert store._purge_conn is not None
        return store._purge_conn.execute("SHOW synchronous_commit").fetchone()[0]

    server = psycopg.connect(database_url, autocommit=True)
    try:
        default = server.execute("SHOW synchronous_commit").fetchone()[0]
        with transaction.atomic():
            ids = stash_many([{"topic": "durable", "key": f"k{i}", "value": "v"} for i in range(3)])
        assert store.take_fence() is None
        assert store.purge([ids[0]], read_fence=False, durable=False) == (1, True)
        assert setting() == default
        assert store.purge([ids[1]], durable=False) == (1, True)
        assert setting() == default
        assert store.purge([ids[2]], read_fence=False, durable=True) == (1, True)
        assert setting() == default
        assert server.execute("SELECT count(*) FROM outbox WHERE id = ANY(%s)", [ids]).fetchone()[0] == 0
    finally:
        store.close()
        server.close()


def test_the_fence_and_purge_sessions_plan_their_statements_once_and_read_by_index(database_url):
    """Planning a mark anew at every execution (a custom plan, for its parameters) cost the server more than
    running it: the fence and purge sessions use each prepared statement's generic plan. Made on an empty
    table (here: analyzed empty, as autovacuum leaves it after a drain), that plan must still read by index,
    or every mark would scan the table however large it grew until it was analyzed again."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DELETE FROM outbox")
        conn.execute("VACUUM ANALYZE outbox")
    store = PostgresStore.open(database_url, "outbox", name="t", group="g")

    def prepared(conn: psycopg.Connection | None) -> dict[str, tuple[str, int, int]]:
        assert conn is not None
        rows = conn.execute("SELECT name, statement, generic_plans, custom_plans FROM pg_prepared_statements")
        return {" ".join(text.split()[:2]): (name, generic, custom) for name, text, generic, custom in rows}

    def plan(conn: psycopg.Connection | None, name: str, arguments: str) -> str:
        assert conn is not None
        return "\n".join(row[0] for row in conn.execute(f"EXPLAIN EXECUTE {name}({arguments})"))

    try:
        assert store.take_fence() is None
        after = 0
        for round_ in range(8):
            with transaction.atomic():
                ids = stash_many([{"topic": "plans", "key": f"k{i}", "value": "v"} for i in range(3)])
            records, _ = store.mark(100, after, ((ids[0], ids[0]),) if round_ % 2 else ())
            after = max(r.id for r in records)
            assert store.purge(ids, read_fence=bool(round_ % 2), durable=False)[0] == 3
        marks, purges = prepared(store._fence_conn), prepared(store._purge_conn)
        # mark, writers, gaps; the fenced and the unfenced purge
        assert len(marks) == 3 and len(purges) == 2, (marks, purges)
        for statement, (_, generic, custom) in {**marks, **purges}.items():
            assert custom == 0 and generic >= 4, (statement, generic, custom)
        mark = plan(store._fence_conn, marks["SELECT id,"][0], f"{after}, 100")
        purge = plan(store._purge_conn, purges["WITH gone"][0], "ARRAY[1]::bigint[], false")
    finally:
        store.close()
    for found in (mark, purge):
        assert "Index Scan using outbox_pkey" in found and "Seq Scan" not in found and "$1" in found, found
