"""A crash of the database server under a running harvester (the postmaster's immediate shutdown, SIGQUIT:
nothing is flushed on the way down, and the next start recovers from the WAL on disk), on a cluster of its
own (`bin/services up --postgres 14 --postgres-only`, as test_postgres_majors.py starts it).

With several records per key in flight (the default) purges commit asynchronously (Lanes.purges_durable):
the crash may undo the last of them and their rows come back; the records are published again, repeats and
nothing else. With one per key a purge is on disk before it answers, so no row the harvester had deleted
comes back, and no key's records go back (the strict order)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest

from tests.integration.test_postgres_majors import OLDEST, ROOT, free_port, running_port, services
from tests.support.harness import Replica, read_topic, replica_env, wait_until

pytestmark = pytest.mark.integration

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


def crash(port: int) -> None:
    """SIGQUIT to the postmaster: an immediate shutdown, the WAL not yet written to disk lost as in a crash."""
    pid = int((ROOT / ".services" / f"postgres-{OLDEST}" / "data" / "postmaster.pid").read_text().splitlines()[0])
    os.kill(pid, signal.SIGQUIT)
    wait_until(lambda: rows(f"postgres://outbox:outbox@127.0.0.1:{port}/outbox") is None, 30, "the server to go")


@pytest.mark.parametrize("per_key", [256, 1])
def test_a_database_crash_repeats_records_but_loses_none_and_reverses_no_key(per_key, bootstrap_servers, new_topic,
                                                                             tmp_path):
    already = running_port(OLDEST)  # a developer's: crashed and started again, and left running
    port = already or free_port()
    url = f"postgres://outbox:outbox@127.0.0.1:{port}/outbox"
    topic = new_topic("db-crash")
    env = replica_env(url, bootstrap_servers, f"test-leader-{uuid.uuid4().hex[:8]}")
    flags = ["--postgres", str(OLDEST), "--postgres-only"]
    up = services("up", *flags, env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        migrated = subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=300)
        assert migrated.returncode == 0, migrated.stderr
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("DELETE FROM outbox")
        crash_while_draining(per_key, url, port, topic, env, flags, bootstrap_servers, tmp_path)
    finally:
        if already is None:
            down = services("down", *flags, env=env)
            assert down.returncode == 0, down.stdout + down.stderr


def crash_while_draining(per_key: int, url: str, port: int, topic: str, env: dict[str, str], flags: list[str],
                         bootstrap_servers: str, tmp_path: Path) -> None:
    replica = Replica(f"db-crash-{per_key}", env, tmp_path,
                      ["--heartbeat-timeout", "2", "--max-in-flight-per-key", str(per_key)])
    try:
        wait_until(replica.is_leading, 60, "the harvester to lead")
        ids = insert(url, topic, 0, BACKLOG, BACKLOG)  # one commit: the harvester drains it with no writer beside
        wait_until(lambda: (rows(url) or BACKLOG) < BACKLOG * 3 // 4, 60, "the drain to be under way")
        left = rows(url)
        assert left is not None
        crash(port)
        up = services("up", *flags, env=env)  # starts it again: recovery from the WAL on disk
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
