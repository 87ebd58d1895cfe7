"""The partitioned outbox against real Postgres and Kafka: converted, harvested, kept.

A scratch copy of the outbox table is partitioned (1,000 ids a partition), written with plain SQL
while an old REPEATABLE READ transaction holds the database's horizon back, and harvested: every
record arrives in per-key order, and the leader truncates and drops the drained partitions, so their
dead rows are gone although vacuum could remove none of them.
"""

from __future__ import annotations

import io
import time
import uuid

import psycopg
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings

from outbox.harvest import partitions
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.harvester import Harvester
from tests.support.harness import assert_complete_and_ordered, read_topic, wait_until

# It holds the server's horizon back on purpose, which other tests would see (test_old_transaction.py): alone.
pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.django_db(transaction=True)]

INSERT = ("INSERT INTO {table} (create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, "
          "kafka_header_values) SELECT now(), %s, 'k' || (g %% 10), g::text, '{{}}', '{{}}' "
          "FROM generate_series(1, %s) g RETURNING id")


@pytest.fixture
def scratch(database_url):
    """A copy of the outbox table (same columns, constraints and trigger), dropped afterwards."""
    table = f"outbox_parted_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (LIKE outbox INCLUDING ALL)")
        conn.execute(f"CREATE TRIGGER outbox_notify AFTER INSERT ON {table} FOR EACH STATEMENT "
                     f"EXECUTE FUNCTION outbox_notify()")
    yield table
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}, {table}_unpartitioned CASCADE")
        conn.execute(f"DROP SEQUENCE IF EXISTS {table}_id_seq")


def test_a_partitioned_outbox_is_harvested_and_its_drained_partitions_leave(database_url, bootstrap_servers,
                                                                            new_topic, scratch, monkeypatch):
    monkeypatch.setattr(partitions, "KEEP_INTERVAL", 0.3)
    topic = new_topic("partitioned")
    writer = psycopg.connect(database_url, autocommit=True)
    before = [row[0] for row in writer.execute(INSERT.format(table=scratch), [topic, 150]).fetchall()]
    made = partitions.convert(writer, scratch, 1000)
    assert [p.default for p in made] == [False, False, False, True], "the old rows, two ahead, the default"
    assert made[0].lo is None and made[1].lo == made[0].hi and made[2].lo == made[1].hi == made[0].hi + 1000
    old = psycopg.connect(database_url, application_name="horizon-holder")
    old.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    old.execute("SELECT count(*) FROM pg_class").fetchone()
    leader = f"test-leader-{uuid.uuid4().hex[:8]}"
    harvester = Harvester(HarvestConfig(dsn=database_url, table=scratch, leader_topic=leader, leader_group=leader,
                                        base_kafka_config={"bootstrap.servers": bootstrap_servers}, name="parted",
                                        limits=Limits(heartbeat_timeout=2.0)))
    harvester.start()
    try:
        wait_until(lambda: harvester.is_leader, 30, "the harvester to lead")
        written = list(before)
        for _ in range(10):  # 5,000 more ids: five partitions' worth, written while the horizon is held
            written += [row[0] for row in writer.execute(INSERT.format(table=scratch), [topic, 500]).fetchall()]
            time.sleep(2 * partitions.KEEP_INTERVAL)  # a steady writer: the leader keeps partitions ahead of it
        wait_until(lambda: not writer.execute(f"SELECT EXISTS (SELECT 1 FROM {scratch})").fetchone()[0], 60,
                   "the partitioned outbox to drain")
        top = max(written)
        wait_until(lambda: all(p.hi is None or p.hi > top
                               for p in partitions.partitions(writer, scratch) if not p.default), 30,
                   "the leader to drop every drained partition")
        kept = partitions.partitions(writer, scratch)
        assert kept[-1].default and kept[-2].hi > top + 1000, "partitions are kept ahead of the ids"
        dead = writer.execute("SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables WHERE relid IN "
                              "(SELECT inhrelid FROM pg_inherits WHERE inhparent = %s::regclass)",
                              [scratch]).fetchone()[0]
        assert dead < 1500, f"{dead} dead rows left: the dropped partitions took the rest with them"
        assert old.info.transaction_status is psycopg.pq.TransactionStatus.INTRANS, "held all along"
        passes, seconds, changed = harvester.round_trips["partitions"]
        assert passes >= 10 and seconds > 0, "each pass of the partition keeper counts as a round trip"
        assert changed >= 5, "its rows: the partitions it created, truncated and dropped"
    finally:
        harvester.stop()
        harvester.wait(timeout=30)
        old.close()
        writer.close()
    audit = read_topic(bootstrap_servers, topic, expected=len(written))
    assert_complete_and_ordered(audit, written, strict=False)


def test_the_command_converts_the_table_refuses_twice_and_lists_the_partitions(scratch, settings, database_url):
    with psycopg.connect(database_url) as conn:
        conn.execute(INSERT.format(table=scratch), ("t", 3))
    with override_settings(OUTBOX={**settings.OUTBOX, "table": scratch}):
        out = io.StringIO()
        call_command("outbox_partition", "--status", stdout=out)
        assert "is not partitioned" in out.getvalue()
        call_command("outbox_partition", "--size", "5000", stdout=out)
        # The failed rows' partial index (the console's stuck-record lookups) is the parent's, so every partition
        # has it, the old rows' (its own index, renamed) and those made later alike.
        with psycopg.connect(database_url) as conn:
            without = conn.execute(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                "WHERE i.inhparent = %s::regclass AND NOT EXISTS (SELECT 1 FROM pg_index x WHERE x.indrelid = c.oid "
                "AND pg_get_expr(x.indpred, x.indrelid) LIKE '%%reset_count > 0%%')", [scratch]).fetchall()
            on_parent = conn.execute("SELECT count(*) FROM pg_index WHERE indrelid = %s::regclass "
                                     "AND indpred IS NOT NULL", [scratch]).fetchone()[0]
        assert without == [] and on_parent == 1, without
        assert f"Partitioned {scratch!r} by id" in out.getvalue()
        with pytest.raises(CommandError, match="partitioned already"):
            call_command("outbox_partition", "--size", "5000")
        with pytest.raises(CommandError, match="at least 1000 ids"):
            call_command("outbox_partition", "--size", "10")
        listing = io.StringIO()
        call_command("outbox_partition", "--status", stdout=listing)
    lines = listing.getvalue().splitlines()
    assert lines[0].split()[:2] == ["partition", "ids"] and "(default)" in listing.getvalue()
    assert sum(1 for line in lines if line.startswith(f"{scratch}_p")) == partitions.AHEAD
    assert lines[-1] == "last id taken: 3", "the ids written before, not 0 before the first new one"


def test_a_burst_past_the_partitions_ahead_lands_in_the_default_partition_and_is_harvested(
        database_url, bootstrap_servers, new_topic, scratch, monkeypatch):
    """Ids beyond the partitions made ahead go to the DEFAULT partition; they are harvested in order like any
    other; the keeper makes partitions ahead of the ids again at once, and once the burst is drained it
    truncates the DEFAULT partition (which stays). Before, a keeper whose partitions were all overtaken and
    dropped knew no width any more and left every later id to the DEFAULT partition."""
    monkeypatch.setattr(partitions, "KEEP_INTERVAL", 0.3)
    topic = new_topic("overflow")
    with psycopg.connect(database_url, autocommit=True) as writer:
        made = partitions.convert(writer, scratch, 1000)
        default, ahead_end = made[-1].name, made[-2].hi
        burst = [row[0] for row in writer.execute(INSERT.format(table=scratch), [topic, 3000]).fetchall()]
        beyond = sum(1 for record_id in burst if record_id >= ahead_end)
        assert beyond > 0 and writer.execute(f"SELECT count(*) FROM {default}").fetchone()[0] == beyond, \
            "the ids past the partitions made ahead are in the DEFAULT partition"
        # The ids overtook every partition: the next ones are made from just past the last id (none can be
        # made over ids the DEFAULT partition holds), AHEAD of them as usual.
        created = partitions.keep(writer, scratch).created
        assert [int(bounds.split("-")[0]) for bounds in created] == [max(burst) + 1, max(burst) + 1001], created
        leader = f"test-leader-{uuid.uuid4().hex[:8]}"
        harvester = Harvester(HarvestConfig(dsn=database_url, table=scratch, leader_topic=leader, leader_group=leader,
                                            base_kafka_config={"bootstrap.servers": bootstrap_servers},
                                            name="overflow", limits=Limits(heartbeat_timeout=2.0)))
        harvester.start()
        try:
            wait_until(lambda: not writer.execute(f"SELECT EXISTS (SELECT 1 FROM {scratch})").fetchone()[0], 60,
                       "the burst to drain, the DEFAULT partition's rows with it")
            top = max(burst)
            wait_until(lambda: any(p.lo is not None and p.lo > top for p in partitions.partitions(writer, scratch)
                                   if not p.default), 30, "the leader to make partitions ahead of the ids again")
            wait_until(lambda: writer.execute("SELECT pg_relation_size(%s::regclass)", [default]).fetchone()[0] == 0,
                       30, "the leader to truncate the drained DEFAULT partition")
            after = [row[0] for row in writer.execute(INSERT.format(table=scratch), [topic, 50]).fetchall()]
            assert writer.execute(f"SELECT count(*) FROM {default}").fetchone()[0] == 0, \
                "new ids go to the partitions made ahead, not the DEFAULT one"
            wait_until(lambda: not writer.execute(f"SELECT EXISTS (SELECT 1 FROM {scratch})").fetchone()[0], 60,
                       "the later records to drain")
            assert partitions.partitions(writer, scratch)[-1].default, "the DEFAULT partition stays"
        finally:
            harvester.stop()
            harvester.wait(timeout=30)
    audit = read_topic(bootstrap_servers, topic, expected=len(burst) + len(after))
    assert_complete_and_ordered(audit, burst + after, strict=False)
