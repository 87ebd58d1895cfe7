"""Where the tests find Postgres and Kafka: the environment, else testcontainers, else bin/services.

One resolver for every test, so a test never knows which path it got:
1. DATABASE_URL / KAFKA_BOOTSTRAP_SERVERS in the environment win;
2. else, when a Docker engine answers and has (or can pull) an image for each service still
   needed, testcontainers starts throwaway containers: the official images where they can be had,
   else the local ones `bin/services images` builds (TEST_POSTGRES_IMAGE / TEST_KAFKA_IMAGE name
   others);
3. else `bin/services up` starts (or finds) the local services, with one line saying why when an
   engine answered but no image could be had.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from tests.support.harness import wait_until

ROOT = Path(__file__).resolve().parents[2]
LOCAL_DATABASE_URL = "postgres://outbox:outbox@127.0.0.1:5432/outbox"
LOCAL_BOOTSTRAP = "127.0.0.1:9092"
KAFKA_VERSION = re.search(r"<kafka\.version>(.+)</kafka\.version>",
                          (ROOT / "services" / "kafka" / "pom.xml").read_text()).group(1)
# Official first; then what `bin/services images` builds (same variables, no registry needed).
LOCAL_IMAGE_PREFIX = "outbox-local/"
POSTGRES_IMAGES = ("postgres:16", f"{LOCAL_IMAGE_PREFIX}postgres:15")
KAFKA_IMAGES = (f"apache/kafka:{KAFKA_VERSION}", f"{LOCAL_IMAGE_PREFIX}kafka:{KAFKA_VERSION}")
# As bin/services configures its cluster: the tests run up to eight harvesters at once.
#: The server as bin/services runs it, pg_stat_statements included (the database-cost tests and the soak read it).
POSTGRES_COMMAND = ("postgres -c max_connections=200 -c shared_buffers=512MB -c work_mem=16MB "
                    "-c max_wal_size=4GB -c autovacuum_naptime=10s "
                    "-c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.track=all")
CONTAINER_START_TIMEOUT = 120
DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"
PULL_TIMEOUT = 600  # seconds without a word from the engine while it pulls (a big layer unpacking)


@dataclass(frozen=True)
class Services:
    database_url: str
    bootstrap_servers: str
    how: str

    def database_url_for(self, name: str) -> str:
        """The same server, another database (the tests use Django's test database)."""
        parts = urlsplit(self.database_url)
        return urlunsplit(parts._replace(path=f"/{name}"))

    def drop_database(self, name: str) -> None:
        """Drop database `name` on this server (gone already is fine): drop_database()."""
        drop_database(self.database_url, name)


def drop_database(admin_url: str, name: str, timeout: float = 60.0) -> None:
    """DROP DATABASE `name` WITH (FORCE), connected through `admin_url`, retried while the server refuses to end
    a session in it for us: an autovacuum worker vacuuming a database a test has just loaded is not the tests'
    role's to end ("permission denied to terminate process"), and it leaves by itself within seconds."""
    import psycopg
    from psycopg import sql

    def dropped() -> bool:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            try:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
            except psycopg.errors.InsufficientPrivilege:
                return False
        return True

    wait_until(dropped, timeout, f"database {name} to be dropped (an autovacuum worker in it)", interval=0.5)


def docker_client() -> Any | None:
    """A client of the Docker engine at DOCKER_HOST (or the usual socket) if one answers, else None."""
    if not unix_socket_answers(docker_host()):
        return None  # none there, or an engine that is gone left its socket: docker-py would leak its own finding out
    try:
        import docker

        client = docker.from_env(timeout=5)
    except Exception:
        return None
    try:
        if client.ping():
            client.api.timeout = PULL_TIMEOUT  # a quick answer to the ping, then patience
            return client
    except Exception:
        pass  # refused or no answer in time: no engine either
    client.close()  # else its socket is left open (a ResourceWarning, an error under pytest)
    return None


def docker_host() -> str:
    """Where docker-py looks for the engine: DOCKER_HOST, else the usual socket."""
    return os.environ.get("DOCKER_HOST") or DEFAULT_DOCKER_HOST


def unix_socket_answers(host: str) -> bool:
    """False when `host` is a unix socket nobody listens on; True for one that accepts, or any other host."""
    if not host.startswith("unix://"):
        return True
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(5)
        try:
            probe.connect(host.removeprefix("unix://"))
        except OSError:
            return False
    return True


def candidates(variable: str, default: tuple[str, ...]) -> tuple[str, ...]:
    chosen = os.environ.get(variable)
    return (chosen,) if chosen else default


def find_image(client: Any, images: tuple[str, ...]) -> tuple[str | None, str]:
    """The first of `images` the engine has, else the first it can pull; else None and why, in one line."""
    import docker.errors

    for image in images:
        with contextlib.suppress(docker.errors.ImageNotFound):
            client.images.get(image)
            return image, ""
    why = []
    for image in images:
        if image.startswith(LOCAL_IMAGE_PREFIX):
            why.append(f"{image} is not built (`bin/services images` builds it)")
            continue
        try:
            client.images.pull(image)
            return image, ""
        except Exception as error:  # refused, unreachable, timed out: all mean "not to be had"
            reason = str(getattr(error, "explanation", None) or error).strip().splitlines()
            why.append(f"{image} cannot be pulled ({reason[0] if reason else type(error).__name__})")
    return None, "; ".join(why)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def container_host() -> str:
    """Where published ports are reached: the engine's host (TESTCONTAINERS_HOST_OVERRIDE wins)."""
    from testcontainers.core.docker_client import DockerClient

    host = DockerClient().host()
    return "127.0.0.1" if host == "localhost" else host  # IPv4 loopback, which every published port has


def start_postgres(stack: contextlib.ExitStack, image: str) -> str:
    from testcontainers.community.postgres import PostgresContainer

    container = PostgresContainer(image, username="outbox", password="outbox", dbname="outbox",
                                  shm_size="256m").with_command(POSTGRES_COMMAND)
    postgres = stack.enter_context(container)
    url = postgres.get_connection_url(host=container_host(), driver=None).replace("postgresql://", "postgres://")
    where = url.split("@")[-1]
    wait_until(lambda: published_port_answers(url), 60, f"the Postgres container's published port ({where})",
               interval=0.2)
    return url


def published_port_answers(url: str) -> bool:
    """testcontainers calls Postgres ready when psql answers inside the container; the published port can still
    close a connection for a moment after (the engine's proxy to the container's address)."""
    import psycopg

    try:
        psycopg.connect(url.replace("postgres://", "postgresql://", 1), connect_timeout=5).close()
    except psycopg.OperationalError:
        return False
    return True


def start_kafka(stack: contextlib.ExitStack, image: str) -> str:
    """One KRaft node configured by KAFKA_* variables, which apache/kafka and the local image share.

    Clients must be told the host's port, so it is chosen before the container starts.
    """
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.wait_strategies import LogMessageWaitStrategy

    host, port = container_host(), free_port()
    container = (
        DockerContainer(image)
        .with_bind_ports(9092, port)
        .with_envs(
            KAFKA_NODE_ID="1",
            KAFKA_PROCESS_ROLES="broker,controller",
            KAFKA_LISTENERS="PLAINTEXT://:9092,CONTROLLER://:9093,BROKER://:29092",
            KAFKA_ADVERTISED_LISTENERS=f"PLAINTEXT://{host}:{port},BROKER://localhost:29092",
            KAFKA_LISTENER_SECURITY_PROTOCOL_MAP="CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,BROKER:PLAINTEXT",
            KAFKA_INTER_BROKER_LISTENER_NAME="BROKER",
            KAFKA_CONTROLLER_LISTENER_NAMES="CONTROLLER",
            KAFKA_CONTROLLER_QUORUM_VOTERS="1@localhost:9093",
            KAFKA_NUM_PARTITIONS="1",
            KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR="1",
            KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR="1",
            KAFKA_TRANSACTION_STATE_LOG_MIN_ISR="1",
            KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR="1",
            KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR="1",
            KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS="0",
            KAFKA_HEAP_OPTS="-Xms1g -Xmx1g",
        )
        .waiting_for(LogMessageWaitStrategy("Kafka Server started").with_startup_timeout(CONTAINER_START_TIMEOUT))
    )
    stack.enter_context(container)
    return f"{host}:{port}"


def use_ryuk_if_available(client: Any) -> str:
    """testcontainers' reaper removes containers a crashed run leaves; without its image, do without it."""
    from testcontainers.core.config import testcontainers_config

    if testcontainers_config.ryuk_disabled:
        return ""
    image, _ = find_image(client, (testcontainers_config.ryuk_image,))
    if image is None:
        testcontainers_config.ryuk_disabled = True
        return " (without ryuk: its image cannot be had)"
    return ""


def with_containers(stack: contextlib.ExitStack, client: Any, database_url: str | None, bootstrap: str | None,
                    say: Callable[[str], None]) -> Services | None:
    """Services from testcontainers, or None (after saying why) when an image cannot be had."""
    wanted = []
    if not database_url:
        wanted.append(("postgres", candidates("TEST_POSTGRES_IMAGE", POSTGRES_IMAGES), start_postgres))
    if not bootstrap:
        wanted.append(("kafka", candidates("TEST_KAFKA_IMAGE", KAFKA_IMAGES), start_kafka))
    found, missing = [], []
    for name, images, start in wanted:
        image, why = find_image(client, images)
        if image is None:
            missing.append(f"no {name} image: {why}")
        else:
            found.append((name, image, start))
    if missing:
        say(f"services: a Docker engine answers, but {'; '.join(missing)}; using bin/services instead")
        return None
    ryuk = use_ryuk_if_available(client)
    for name, image, start in found:
        address = start(stack, image)
        if name == "postgres":
            database_url = address
        else:
            bootstrap = address
    how = "testcontainers " + ", ".join(f"{name} ({image})" for name, image, _ in found) + ryuk
    say(f"services: {how}")
    assert database_url and bootstrap
    return Services(database_url, bootstrap, how)


def with_bin_services(database_url: str | None, bootstrap: str | None) -> Services:
    result = subprocess.run([sys.executable, str(ROOT / "bin" / "services"), "up"], env=dict(os.environ), text=True,
                            capture_output=True)
    if result.returncode != 0:
        raise RuntimeError(f"bin/services up failed: {(result.stderr or result.stdout).strip()}")
    return Services(database_url or LOCAL_DATABASE_URL, bootstrap or LOCAL_BOOTSTRAP, "bin/services")


def say_on_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def resolve(stack: contextlib.ExitStack, say: Callable[[str], None] = say_on_stderr) -> Services:
    database_url = os.environ.get("DATABASE_URL")
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if database_url and bootstrap:
        return Services(database_url, bootstrap, "environment")
    client = docker_client()
    if client is not None:
        with contextlib.closing(client):
            found = with_containers(stack, client, database_url, bootstrap, say)
        if found is not None:
            return found
    return with_bin_services(database_url, bootstrap)
