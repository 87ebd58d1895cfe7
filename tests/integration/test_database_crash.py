"""A crash of the database server under a running harvester (the postmaster's immediate shutdown, SIGQUIT:
nothing is flushed on the way down, and the next start recovers from the WAL on disk), on a cluster of its
own (`bin/services up --postgres 14 --postgres-only`, as test_postgres_majors.py starts it).

With several records per key in flight (the default) purges commit asynchronously (Settling.purges_durable):
the crash may undo the last of them and their rows come back; the records are published again, repeats and
nothing else. With one per key a purge is on disk before it answers, so no row the harvester had deleted
comes back, and no key's records go back (the strict order)."""

from __future__ import annotations

import signal
from pathlib import Path

import psutil
import psycopg
import pytest

from tests.support.harness import Replica, read_topic, wait_until
from tests.support.oldest_postgres import Cluster, oldest_postgres, services

# The oldest major's own cluster (tests/support/oldest_postgres.py) serves one test at a time: one worker. It is the
# server whatever DATABASE_URL names, so the PostgreSQL 18 stage would run the same test on the same server again.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("oldest-postgres"), pytest.mark.postgres_agnostic]

KEYS = 20
BACKLOG = 100_000
AFTER = 2_000


def rows(url: str) -> int | None:
    try:
        with psycopg.connect(url, connect_timeout=2) as conn:
            return conn.execute("SELECT count(*) FROM outbox").fetchone()[0]
    except psycopg.OperationalError:
        return None


def insert(url: str, topic: str, first: int, count: int, per_transaction: int) -> list[int]:
    """A plain-SQL writer: `count` records over KEYS keys, `per_transaction` a commit (each waits for its flush)."""
    ids: list[int] = []
    with psycopg.connect(url, autocommit=True) as conn:
        for start in range(first, first + count, per_transaction):
            end = min(start + per_transaction, first + count) - 1
            ids += [row[0] for row in conn.execute(
                "INSERT INTO outbox (kafka_topic, kafka_key, kafka_value) SELECT %s, 'k' || (n %% %s), 'v' || n "
                "FROM generate_series(%s::int, %s::int) AS n ORDER BY n RETURNING id",
                [topic, KEYS, start, end]).fetchall()]
    return ids


def crash(cluster: Cluster) -> None:
    """SIGQUIT to the postmaster: an immediate shutdown, the WAL not yet written to disk lost as in a crash. Done
    when the postmaster has exited: it refuses connections ("the database system is shutting down") while its
    children exit, and a start in that time finds it still there."""
    postmaster = psutil.Process(cluster.postmaster_pid())
    postmaster.send_signal(signal.SIGQUIT)

    def exited() -> bool:
        try:
            return postmaster.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(exited, 30, "the postmaster to exit")
    assert rows(cluster.url) is None


@pytest.mark.slow
@pytest.mark.parametrize("per_key", [256, 1])
def test_a_database_crash_repeats_records_but_loses_none_and_reverses_no_key(per_key, bootstrap_servers, new_topic,
                                                                             tmp_path):
    """Slow: a server of its own (the oldest major) started, crashed mid-drain
    and started again."""
    topic = new_topic("db-crash")
    with oldest_postgres(bootstrap_servers) as cluster:
        crash_while_draining(per_key, cluster, topic, bootstrap_servers, tmp_path)


def crash_while_draining(per_key: int, cluster: Cluster, topic: str, bootstrap_servers: str, tmp_path: Path) -> None:
    url = cluster.url
    replica = Replica(f"db-crash-{per_key}", cluster.env, tmp_path,
                      ["--heartbeat-timeout", "2", "--max-in-flight-per-key", str(per_key)])
    try:
        wait_until(replica.is_leading, 60, "the harvester to lead")
        ids = insert(url, topic, 0, BACKLOG, BACKLOG)  # one commit: the harvester drains it with no writer beside
        wait_until(lambda: (n := rows(url)) is not None and n < BACKLOG * 3 // 4, 60, "the drain to be under way")
        left = rows(url)
        assert left is not None
        crash(cluster)
        up = services("up", *cluster.flags, env=cluster.env)  # starts it again: recovery from the WAL on disk
        assert up.returncode == 0, up.stdout + up.stderr
        back = rows(url)
        assert back is not None
        if per_key == 1:
            assert back <= left, f"{back - left} deleted row(s) came back with one record per key in flight"
        ids += insert(url, topic, BACKLOG, AFTER, 20)
        wait_until(lambda: rows(url) == 0, 120, "the harvester to drain the outbox after the crash")
    finally:
        replica.signal(signal.SIGTERM)
        replica.wait()
    audit = read_topic(bootstrap_servers, topic, expected=len(ids))
    assert audit.ids == set(ids), f"{len(set(ids) - audit.ids)} record(s) never published"
    assert not audit.reversals(strict=per_key == 1), audit.reversals(strict=per_key == 1)[:5]
    print(f"per key {per_key}: {left} rows before the crash, {back} after recovery; "
          f"{audit.duplicates} repeats of {len(ids)} records")
