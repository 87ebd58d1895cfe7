"""Where the tests find Postgres and Kafka: the environment, else testcontainers, else bin/services.

One resolver for every test, so a test never knows which path it got:
1. DATABASE_URL / KAFKA_BOOTSTRAP_SERVERS in the environment win;
2. else, when a Docker engine answers, testcontainers starts throwaway containers;
3. else `bin/services up` starts (or finds) the local services.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
LOCAL_DATABASE_URL = "postgres://outbox:outbox@127.0.0.1:5432/outbox"
LOCAL_BOOTSTRAP = "127.0.0.1:9092"


@dataclass(frozen=True)
class Services:
    database_url: str
    bootstrap_servers: str
    how: str

    def database_url_for(self, name: str) -> str:
        """The same server, another database (the tests use Django's test database)."""
        parts = urlsplit(self.database_url)
        return urlunsplit(parts._replace(path=f"/{name}"))


def docker_available() -> bool:
    if not os.environ.get("DOCKER_HOST") and not Path("/var/run/docker.sock").exists():
        return False
    try:
        import docker

        with contextlib.closing(docker.from_env(timeout=3)) as client:
            return bool(client.ping())
    except Exception:
        return False


def resolve(stack: contextlib.ExitStack) -> Services:
    database_url = os.environ.get("DATABASE_URL")
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    how = []
    if database_url and bootstrap:
        return Services(database_url, bootstrap, "environment")
    if docker_available():
        if not database_url:
            from testcontainers.postgres import PostgresContainer

            postgres = stack.enter_context(PostgresContainer("postgres:16", username="outbox", password="outbox",
                                                             dbname="outbox"))
            database_url = postgres.get_connection_url(driver=None).replace("postgresql://", "postgres://")
            how.append("testcontainers postgres")
        if not bootstrap:
            from testcontainers.kafka import KafkaContainer

            kafka = stack.enter_context(KafkaContainer("apache/kafka:4.1.1").with_kraft())
            bootstrap = kafka.get_bootstrap_server()
            how.append("testcontainers kafka")
        return Services(database_url, bootstrap, ", ".join(how))
    env = dict(os.environ)
    result = subprocess.run([sys.executable, str(ROOT / "bin" / "services"), "up"], env=env, text=True,
                            capture_output=True)
    if result.returncode != 0:
        raise RuntimeError(f"bin/services up failed: {(result.stderr or result.stdout).strip()}")
    return Services(database_url or LOCAL_DATABASE_URL, bootstrap or LOCAL_BOOTSTRAP, "bin/services")
