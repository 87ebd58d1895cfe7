"""tests/support/services.py against a real Docker engine: containers from the images it has, else bin/services."""

from __future__ import annotations

import contextlib
import time
import uuid

import psycopg
import pytest
from confluent_kafka import Consumer, Producer

from tests.support import services
from tests.support.docker_require import unavailable

pytestmark = [pytest.mark.docker, pytest.mark.integration]


@pytest.fixture
def no_environment(monkeypatch):
    for name in ("DATABASE_URL", "KAFKA_BOOTSTRAP_SERVERS", "TEST_POSTGRES_IMAGE", "TEST_KAFKA_IMAGE"):
        monkeypatch.delenv(name, raising=False)


def containers(engine) -> set[str]:
    return {container.id for container in engine.containers.list(all=True, filters={"label": "org.testcontainers"})}


def round_trip(bootstrap: str) -> bytes:
    """Produce one message to a new topic and read it back; returns its value."""
    topic, value = f"tc-{uuid.uuid4().hex[:12]}", uuid.uuid4().hex.encode()
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(topic, key=b"k", value=value)
    assert producer.flush(30) == 0, f"the message to {topic} was not acknowledged within 30 s"
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": topic, "auto.offset.reset": "earliest"})
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is not None and message.error() is None:
                return message.value()
        raise AssertionError(f"nothing arrived on {topic} within 60 s")
    finally:
        consumer.close()


def test_containers_from_the_images_there_are_and_gone_afterwards(docker_engine, no_environment):
    wanted = []
    for images in (services.POSTGRES_IMAGES, services.KAFKA_IMAGES):
        image, why = services.find_image(docker_engine, images)
        if image is None:
            unavailable(f"no image to test with: {why}")
        wanted.append(image)
    before = containers(docker_engine)
    said: list[str] = []
    with contextlib.ExitStack() as stack:
        found = services.resolve(stack, say=said.append)
        assert found.how.startswith("testcontainers") and all(image in found.how for image in wanted), found.how
        assert said == [f"services: {found.how}"]
        started = containers(docker_engine) - before
        assert len(started) == 2, started
        with psycopg.connect(found.database_url.replace("postgres://", "postgresql://", 1)) as connection:
            assert connection.execute("SHOW max_connections").fetchone() == ("200",)
            assert connection.execute("SELECT rolcreatedb FROM pg_roles WHERE rolname = 'outbox'").fetchone() == (True,)
        assert round_trip(found.bootstrap_servers)
    assert not started & containers(docker_engine), "containers left after the fixture closed"


def test_no_image_to_be_had_means_bin_services_and_one_line(docker_engine, no_environment, monkeypatch):
    missing = f"outbox-local/missing-{uuid.uuid4().hex[:8]}:1"
    monkeypatch.setenv("TEST_KAFKA_IMAGE", missing)
    before = containers(docker_engine)
    said: list[str] = []
    with contextlib.ExitStack() as stack:
        found = services.resolve(stack, say=said.append)
    assert found.how == "bin/services"
    assert said == [f"services: a Docker engine answers, but no kafka image: {missing} is not built "
                    "(`bin/services images` builds it); using bin/services instead"]
    assert containers(docker_engine) == before, "a container was started all the same"
    with psycopg.connect(found.database_url.replace("postgres://", "postgresql://", 1), connect_timeout=10) as c:
        assert c.execute("SELECT 1").fetchone() == (1,)
    assert round_trip(found.bootstrap_servers)
