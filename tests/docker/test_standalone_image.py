"""The stand-alone harvester's image (Dockerfile.standalone, built by `bin/services images`) as an operator runs
it: the schema applied from the image, rows written by plain SQL, published, the probe, and `docker stop`
ending it cleanly. On the host's network, so it reaches the tests' services on 127.0.0.1."""

from __future__ import annotations

import psycopg
import pytest

from tests.support import services
from tests.support.docker_require import unavailable
from tests.support.harness import assert_complete_and_ordered, read_topic, wait_until

pytestmark = [pytest.mark.docker, pytest.mark.integration]

IMAGE = "outbox-local/outbox-harvest:latest"
INSERT = ("INSERT INTO outbox (kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values) "
          "VALUES (%s, %s, %s, '{}', '{}') RETURNING id")


def test_the_image_applies_the_schema_harvests_and_stops_cleanly(docker_engine, fresh_database, bootstrap_servers,
                                                                 new_topic):
    if not services.find_image(docker_engine, (IMAGE,))[0]:
        unavailable(f"no image {IMAGE}: build it with `bin/services images`")
    _name, url = fresh_database
    environment = {"DATABASE_URL": url, "KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers}

    def run(*command: str) -> str:
        return docker_engine.containers.run(IMAGE, list(command), environment=environment, network_mode="host",
                                            remove=True).decode()

    assert run("schema", "--apply").startswith("applied 9 migration(s)")
    topic = new_topic("standalone-image")
    with psycopg.connect(url) as conn:
        ids = [conn.execute(INSERT, (topic, f"key-{i % 4}", f"v{i}")).fetchone()[0] for i in range(40)]
    container = docker_engine.containers.run(IMAGE, ["--name", "in-a-container", "--heartbeat-timeout", "2"],
                                             environment=environment, network_mode="host", detach=True)
    try:
        audit = read_topic(bootstrap_servers, topic, expected=len(ids), timeout=90)
        probe = wait_until(lambda: (found := container.exec_run(["outbox-harvest", "health", "--name",
                                                                 "in-a-container", "--require-leader"]))
                           .exit_code == 0 and found, 60, "a healthy probe")
        assert probe.output.decode().startswith("ok: in-a-container is leader")
        container.stop(timeout=30)
        assert container.wait(timeout=60)["StatusCode"] == 0
        logs = container.logs().decode()
    finally:
        container.remove(force=True)
    assert_complete_and_ordered(audit, ids, strict=True)
    assert "Stopped (published 40, failed 0)" in logs, logs[-2000:]
