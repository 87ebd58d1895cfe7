"""Postgres going away while harvesting: the harvester backs off, recovers, and loses nothing."""

from __future__ import annotations

import time
import uuid

import pytest

from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.harvester import Harvester
from project.bench.proxy import proxied_url
from tests.support.harness import Generator, assert_complete_and_ordered, outbox_count, read_topic, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def test_postgres_outage_while_harvesting(database_url, bootstrap_servers, new_topic):
    topic = new_topic("outage")
    proxy, proxied = proxied_url(database_url)
    leader = f"test-leader-{uuid.uuid4().hex[:8]}"
    harvester = Harvester(HarvestConfig(dsn=proxied, base_kafka_config={"bootstrap.servers": bootstrap_servers},
                                        leader_topic=leader, leader_group=leader, name="outage-replica",
                                        limits=Limits(heartbeat_timeout=2.0, io_error_backoff=0.2)))
    generator = Generator(topic, pause=0.01)
    harvester.start()
    try:
        generator.start()
        wait_until(lambda: harvester.published > 500, 60, "harvesting under way")
        proxy.cut()
        time.sleep(4)  # marks and purges fail meanwhile; the generator keeps writing directly
        published_during_outage = harvester.published
        proxy.restore()
        wait_until(lambda: harvester.published > published_during_outage + 500, 60, "harvesting to resume")
        stashed = generator.stop()
        wait_until(lambda: outbox_count(database_url) == 0, 120, "the outbox to drain")
        assert harvester.state.value == "running", "an outage is survived, not fatal"
    finally:
        generator.halt.set()
        harvester.stop()
        harvester.wait(timeout=30)
        proxy.close()
    assert_complete_and_ordered(read_topic(bootstrap_servers, topic, expected=len(stashed)), stashed)
