"""docker-compose.yml as a user runs it: bring the stack up, order in the shop, see the event on Kafka.

With the local images (docker-compose.local.yml) where `bin/services images` built them, else the
official ones. Host ports are free ones, not the usual, so it runs beside other services; the stack
is taken down (containers, network, volumes, built images) whatever happens.

Slow: compose builds the example image and starts Postgres, Kafka, the shop and the harvester in containers.
"""

from __future__ import annotations

import http.cookiejar
import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer

from tests.support import services
from tests.support.docker_require import unavailable

pytestmark = [pytest.mark.docker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
LOCAL_IMAGES = ("outbox-local/postgres:15", f"outbox-local/kafka:{services.KAFKA_VERSION}", "outbox-local/python:3.11")
UP_TIMEOUT = 600  # builds the example image when it is not cached (pip install)
SHOP_TIMEOUT = 180
DELIVERY_TIMEOUT = 120
DOWN_TIMEOUT = 120


def compose_command() -> list[str] | None:
    """The compose v2 plugin, else Debian's docker-compose (v1)."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def has_images(engine, images) -> bool:
    return all(services.find_image(engine, (image,))[0] for image in images)


class Shop:
    """The example shop over HTTP, with the session and CSRF cookies a browser would keep."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))

    def wait_until_up(self, timeout: float) -> str:
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            try:
                with self.opener.open(self.url, timeout=5) as response:
                    return response.read().decode()
            except (urllib.error.URLError, ConnectionError) as error:
                last = error
                time.sleep(1)
        raise AssertionError(f"the shop at {self.url} did not answer within {timeout:.0f} s: {last}")

    def place_order(self, item: str, quantity: int) -> str:
        page = self.wait_until_up(SHOP_TIMEOUT)
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
        form = urllib.parse.urlencode({"csrfmiddlewaretoken": token, "item": item, "quantity": quantity})
        with self.opener.open(self.url, data=form.encode(), timeout=30) as response:  # follows the redirect
            return response.read().decode()


def wait_for_event(bootstrap: str, item: str) -> tuple[dict, dict[str, bytes]]:
    """The `orders` event for `item` (value and headers) as a downstream consumer reads it."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"smoke-{uuid.uuid4().hex[:8]}",
                         "auto.offset.reset": "earliest", "topic.metadata.refresh.interval.ms": 1000})
    try:
        consumer.subscribe(["orders"])
        deadline = time.monotonic() + DELIVERY_TIMEOUT
        while time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is None or message.error() is not None:  # the topic may not exist yet
                continue
            value = json.loads(message.value())
            if value.get("item") == item:
                return value, dict(message.headers() or [])
        raise AssertionError(f"no `orders` event for {item} on {bootstrap} within {DELIVERY_TIMEOUT} s")
    finally:
        consumer.close()


def test_an_order_in_the_shop_reaches_kafka_and_down_leaves_nothing(docker_engine, tmp_path):
    compose = compose_command()
    if compose is None:
        unavailable("neither `docker compose` nor `docker-compose` is installed")
    files = ["-f", "docker-compose.yml"]
    if has_images(docker_engine, LOCAL_IMAGES):
        files += ["-f", "docker-compose.local.yml"]
    elif not has_images(docker_engine, ("postgres:16", f"apache/kafka:{services.KAFKA_VERSION}", "python:3.12-slim")):
        unavailable("neither the local images (`bin/services images`) nor the official ones can be had")
    project = f"outbox-smoke-{uuid.uuid4().hex[:8]}"
    ports = {name: services.free_port() for name in ("POSTGRES_PORT", "KAFKA_PORT", "SHOP_PORT")}
    env = {**os.environ, **{name: str(port) for name, port in ports.items()}}
    run = [*compose, "--project-name", project, *files]

    def compose_do(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*run, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)

    try:
        up = compose_do("up", "--detach", "--build", timeout=UP_TIMEOUT)
        assert up.returncode == 0, up.stderr[-3000:]
        item = f"smoke-{uuid.uuid4().hex[:8]}"
        page = Shop(f"http://127.0.0.1:{ports['SHOP_PORT']}/").place_order(item, 3)
        assert f"3 x {item}" in page
        value, headers = wait_for_event(f"127.0.0.1:{ports['KAFKA_PORT']}", item)
        assert value["event"] == "placed" and value["quantity"] == 3
        assert headers["outbox-id"].decode().isdigit() and headers["outbox-create-time"].endswith(b"Z")
    except BaseException:
        logs = compose_do("logs", "--no-color", "--tail", "30", timeout=60)
        (tmp_path / "compose.log").write_text(logs.stdout + logs.stderr)
        print(f"compose logs: {tmp_path / 'compose.log'}")
        raise
    finally:
        down = compose_do("down", "--volumes", "--rmi", "local", "--remove-orphans", "--timeout", "20",
                          timeout=DOWN_TIMEOUT)
    assert down.returncode == 0, down.stderr[-3000:]
    label = {"label": f"com.docker.compose.project={project}"}
    assert docker_engine.containers.list(all=True, filters=label) == []
    assert docker_engine.networks.list(filters=label) == []
    assert docker_engine.volumes.list(filters=label) == []
    assert [image.tags for image in docker_engine.images.list() if any(project in tag for tag in image.tags)] == []
