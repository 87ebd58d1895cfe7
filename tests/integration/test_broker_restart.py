"""`manage.py harvest` through a restart of the only broker (`bin/services up --spare`, a broker of the tests' own):
it keeps running, says what it waits for, and every record stashed before, during and after the restart reaches
a consumer in per-key order."""

from __future__ import annotations

import signal
import time

import pytest

from tests.support.harness import (
    Generator,
    Replica,
    TopicTail,
    assert_complete_and_ordered,
    outbox_count,
    replica_env,
    wait_until,
)
from tests.support.kafka_cluster import Cluster

# a restart of Kafka's only broker: the same on any PostgreSQL server (not in make test-postgres18)
pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True), pytest.mark.postgres_agnostic]

#: How long the broker stays down: past the harvester's heartbeat timeout and the producer's delivery timeout.
DOWN_FOR = 16.0


@pytest.fixture
def broker(spare_broker: Cluster):
    spare_broker.up()
    yield spare_broker
    spare_broker.up()


@pytest.mark.slow
def test_harvest_rides_through_a_restart_of_the_only_broker(broker, database_url, tmp_path):
    """Slow: the broker stays down 16 s, past the heartbeat and delivery timeouts, then a new term and the drain."""
    topic = broker.create_topic("records", partitions=3)
    leader_topic = broker.create_topic("leader", partitions=1)
    env = {**replica_env(database_url, broker.bootstrap_servers, leader_topic), **broker.environment()}
    replica = Replica("restarted", env, tmp_path)
    tail = TopicTail(broker.bootstrap_servers, topic, broker.client_config())
    generator = Generator(topic, pause=0.05)
    try:
        tail.start()
        wait_until(replica.is_leading, 60, "the replica to lead")
        generator.start()
        wait_until(lambda: tail.audit.messages > 300, 60, "harvesting under way")
        broker.stop(1)
        time.sleep(DOWN_FOR)  # the outage itself: the generator keeps stashing
        assert replica.process.poll() is None, replica.log()
        broker.up()
        back_at = time.time()
        newest = max(generator.ids)
        wait_until(lambda: any(record_id > newest for _, record_id in tail.arrivals), 60,
                   "records stashed after the broker's return to reach the consumer")
        stashed = generator.stop()
        wait_until(lambda: outbox_count(database_url) == 0, 120, "the outbox to drain")
        wait_until(lambda: tail.has(stashed), 60, "the consumer to see every record")
        assert replica.process.poll() is None, replica.log()
    finally:
        generator.halt.set()
        replica.signal(signal.SIGTERM)
        code = replica.wait(timeout=60)
        audit = tail.stop()
    assert code == 0, replica.log()
    assert_complete_and_ordered(audit, stashed)
    print(f"\nbroker down {DOWN_FOR:g} s: records stashed after its return reached the consumer "
          f"{tail.first_arrival_after(back_at, newest):.1f} s after it; {audit.messages} messages, "
          f"{audit.duplicates} repeats; the tail restarted {tail.restarts} time(s)")
