"""tests/support/services.py's choices, against a stand-in Docker engine: which images, and when bin/services.

The same branches run against a real engine in tests/docker/.
"""

from __future__ import annotations

import contextlib
import re
import runpy
from pathlib import Path

import docker.errors
import pytest

from tests.support import services

ROOT = Path(__file__).resolve().parents[2]


class Images:
    """The part of docker-py's `client.images` the resolver uses, over a set of names."""

    def __init__(self, present: set[str], pullable: set[str]) -> None:
        self.present, self.pullable, self.pulled = set(present), pullable, []

    def get(self, name: str) -> object:
        if name not in self.present:
            raise docker.errors.ImageNotFound(f"No such image: {name}")
        return object()

    def pull(self, name: str) -> object:
        self.pulled.append(name)
        if name not in self.pullable:
            raise docker.errors.APIError("500 Server Error", explanation=(
                'Get "https://registry-1.docker.io/v2/": dial tcp: lookup registry-1.docker.io: no such host\n'
                "second line"))
        self.present.add(name)
        return object()


class Engine:
    def __init__(self, present: set[str] = frozenset(), pullable: set[str] = frozenset()) -> None:
        self.images = Images(present, pullable)
        self.closed = False

    def close(self) -> None:
        self.closed = True


OFFICIAL_POSTGRES, LOCAL_POSTGRES = services.POSTGRES_IMAGES
OFFICIAL_KAFKA, LOCAL_KAFKA = services.KAFKA_IMAGES


@pytest.fixture
def no_environment(monkeypatch):
    for name in ("DATABASE_URL", "KAFKA_BOOTSTRAP_SERVERS", "TEST_POSTGRES_IMAGE", "TEST_KAFKA_IMAGE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def started(monkeypatch):
    """Record which images the resolver would start, instead of starting containers."""
    calls = []
    monkeypatch.setattr(services, "start_postgres", lambda stack, image: calls.append(image) or "postgres://pg")
    monkeypatch.setattr(services, "start_kafka", lambda stack, image: calls.append(image) or "kafka:1")
    monkeypatch.setattr(services, "use_ryuk_if_available", lambda client: "")
    return calls


@pytest.fixture
def fallback(monkeypatch):
    calls = []

    def with_bin_services(database_url, bootstrap):
        calls.append((database_url, bootstrap))
        return services.Services("postgres://local", "local:9092", "bin/services")

    monkeypatch.setattr(services, "with_bin_services", with_bin_services)
    return calls


def resolve_with(monkeypatch, engine: Engine | None) -> tuple[services.Services, list[str]]:
    monkeypatch.setattr(services, "docker_client", lambda: engine)
    said: list[str] = []
    with contextlib.ExitStack() as stack:
        return services.resolve(stack, say=said.append), said


def test_the_environment_wins_without_asking_docker(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgres://u:p@db:5432/x")
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "k:9092")
    monkeypatch.setattr(services, "docker_client", lambda: pytest.fail("asked for a Docker engine"))
    found = services.resolve(contextlib.ExitStack())
    assert found == services.Services("postgres://u:p@db:5432/x", "k:9092", "environment")


def test_no_engine_means_bin_services_without_a_word(monkeypatch, no_environment, fallback):
    found, said = resolve_with(monkeypatch, None)
    assert found.how == "bin/services" and fallback == [(None, None)] and said == []


def test_an_engine_with_the_local_images_gets_testcontainers(monkeypatch, no_environment, started, fallback):
    engine = Engine(present={LOCAL_POSTGRES, LOCAL_KAFKA})
    found, said = resolve_with(monkeypatch, engine)
    assert started == [LOCAL_POSTGRES, LOCAL_KAFKA] and fallback == []
    assert found == services.Services("postgres://pg", "kafka:1", found.how)
    assert said == [f"services: {found.how}"] and LOCAL_KAFKA in found.how
    assert engine.images.pulled == [] and engine.closed


def test_official_images_come_first_and_are_pulled_when_missing(monkeypatch, no_environment, started, fallback):
    engine = Engine(present={LOCAL_KAFKA}, pullable={OFFICIAL_POSTGRES, OFFICIAL_KAFKA})
    resolve_with(monkeypatch, engine)
    # Kafka: an image already there beats a pull; Postgres: the official image is pulled.
    assert started == [OFFICIAL_POSTGRES, LOCAL_KAFKA] and engine.images.pulled == [OFFICIAL_POSTGRES]


def test_only_the_missing_service_is_started(monkeypatch, no_environment, started, fallback):
    monkeypatch.setenv("DATABASE_URL", "postgres://u:p@db:5432/x")
    found, _ = resolve_with(monkeypatch, Engine(present={LOCAL_KAFKA}))
    assert started == [LOCAL_KAFKA] and found.database_url == "postgres://u:p@db:5432/x"


def test_an_engine_without_images_falls_back_with_one_line(monkeypatch, no_environment, started, fallback):
    found, said = resolve_with(monkeypatch, Engine(present={LOCAL_POSTGRES}))
    assert found.how == "bin/services" and started == [] and fallback == [(None, None)]
    assert len(said) == 1 and "\n" not in said[0]
    line = said[0]
    assert line.startswith("services: a Docker engine answers, but no kafka image: ")
    assert f"{OFFICIAL_KAFKA} cannot be pulled (Get " in line and "no such host)" in line
    assert f"{LOCAL_KAFKA} is not built (`bin/services images` builds it)" in line
    assert line.endswith("; using bin/services instead") and "postgres image" not in line


def test_named_images_replace_the_defaults(monkeypatch, no_environment, started, fallback):
    monkeypatch.setenv("TEST_POSTGRES_IMAGE", "registry.example/pg:16")
    found, said = resolve_with(monkeypatch, Engine(present={LOCAL_POSTGRES, LOCAL_KAFKA}))
    assert found.how == "bin/services" and "no postgres image: registry.example/pg:16 cannot be pulled" in said[0]


def test_image_names_agree_with_bin_services_and_compose():
    """The names the fixture looks for are the ones `bin/services images` builds and compose uses."""
    built = runpy.run_path(str(ROOT / "bin" / "services"), run_name="bin_services")["LocalImages"]()
    assert built.postgres == LOCAL_POSTGRES and built.kafka_image == LOCAL_KAFKA
    override = (ROOT / "docker-compose.local.yml").read_text()
    for image in (built.postgres, built.kafka_image, built.python):
        assert f"{image}" in override
    compose = (ROOT / "docker-compose.yml").read_text()
    assert set(re.findall(r"image: (\S+)", compose)) == {OFFICIAL_POSTGRES, OFFICIAL_KAFKA}  # the cluster's nodes too
    assert set(re.findall(r"image: (\S+)", override)) == {built.postgres, built.kafka_image}
    with_images = services_with(compose, r"image:|<<: \*kafka-node")  # the cluster's nodes share kafka-1's
    assert with_images - services_with(override, r"image:") == set(), "every official image is swapped locally"


def services_with(compose: str, pattern: str) -> set[str]:
    """Names of the compose file's services whose block has a line matching `pattern`."""
    found, service = set(), None
    for line in compose.splitlines():
        if match := re.match(r"^  ([a-z0-9-]+):", line):
            service = match[1]
        elif service and re.search(pattern, line):
            found.add(service)
    return found


def test_a_socket_an_engine_left_behind_is_no_engine_and_leaks_nothing(monkeypatch, tmp_path):
    """A stopped dockerd leaves /var/run/docker.sock; docker-py refused there left its own socket open
    (a ResourceWarning, which this suite turns into an error in whichever test the collector hits)."""
    import gc
    import socket
    import warnings

    path = tmp_path / "docker.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
        gone.bind(str(path))  # the file stays, nobody listens
    monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert services.docker_client() is None
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []


def test_dropping_a_database_waits_out_an_autovacuum_worker_the_role_cannot_end(monkeypatch):
    """DROP DATABASE ... WITH (FORCE) by a role that is not a superuser fails while an autovacuum worker is in the
    database (seen on PostgreSQL 18 after a test loaded it); the drop is tried again until the worker left."""
    import psycopg

    refusals = [psycopg.errors.InsufficientPrivilege("permission denied to terminate process")] * 2
    tried: list[str] = []

    class Connection:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def execute(self, statement):
            tried.append(statement.as_string(None))
            if refusals:
                raise refusals.pop()

    monkeypatch.setattr(psycopg, "connect", lambda url, autocommit: Connection())
    def wait_until(condition, timeout, what, interval):  # waits on no clock: the condition, asked until true
        return next(result for result in (condition() for _ in range(5)) if result)

    monkeypatch.setattr(services, "wait_until", wait_until)
    services.drop_database("postgres://outbox@127.0.0.1/outbox", "loaded")
    assert tried == ['DROP DATABASE IF EXISTS "loaded" WITH (FORCE)'] * 3
