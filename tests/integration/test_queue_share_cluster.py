"""The share backend on the three-node cluster (`bin/services up --brokers 3`) while a broker dies: two
consumers handle a queue's messages, the node leading most of the queue's partitions is SIGKILLed in the
middle and started again; every message is handled, none lost.

Some messages are handled twice, and not always as another delivery: the partitions' new leaders read
each record's state from the share coordinator, which Kafka writes when records are acknowledged or
released, not when they are acquired, so what the dead leader had handed out comes back with the same
delivery count (docs/queue-backends.md, "A broker that dies (share)"). At least once, never lost.

Skipped where the cluster's brokers have no share groups (a cluster formatted before Kafka 4.2).

Slow: the killed node's partitions move, its records' locks time out, and the node is started again and
caught up."""

from __future__ import annotations

import collections
import signal
import time

import pytest

from outbox.queue import api, app_settings
from tests.support.harness import Process, wait_until
from tests.support.kafka_cluster import Cluster
from tests.support.queue_harness import events, new_prefix, process_env, queue_settings, share_groups_missing

# a broker killed under share consumers: the same on any PostgreSQL server (not in make test-postgres18)
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.django_db(transaction=True),
              pytest.mark.postgres_agnostic]

#: The record lock (redelivery_timeout): long enough for a batch of 10 ms handlers on a loaded machine.
LOCK = 10.0
MESSAGES = 600


@pytest.fixture
def cluster(kafka_cluster: Cluster):
    """The three-node cluster, every node up and in sync, before and after."""
    kafka_cluster.heal()
    yield kafka_cluster
    kafka_cluster.heal()


def test_a_broker_killed_under_two_share_consumers_loses_no_message(cluster, settings, database_url, tmp_path):
    reason = share_groups_missing(cluster.bootstrap_servers)
    if reason is not None:
        pytest.skip(f"the cluster has no share groups (needs Apache Kafka 4.2+): {reason}")
    prefix = new_prefix()
    settings.OUTBOX = {**settings.OUTBOX, "base_kafka_config": cluster.client_config(),
                       "queues": queue_settings(prefix, backend="share", redelivery_timeout=LOCK, max_deliveries=9)}
    ids = set(api.send_many("theta", [{"n": n} for n in range(MESSAGES)]))
    topic = app_settings.queue_config().share_topic("theta")
    log_path = tmp_path / "events.log"
    env = {**process_env(database_url, cluster.bootstrap_servers, prefix, log_path, mode="sleep:0.01"),
           **cluster.environment(), "OUTBOX_QUEUE_BACKEND": "share"}
    args = ["--queue", "theta", "--handler", "tests.support.queue_handlers.record", "--redelivery-timeout", str(LOCK),
            "--max-deliveries", "9", "--workers", "2", "--max-in-progress", "4"]
    consumers = [Process(f"consumer-{n}", "outbox_consume", args, env, tmp_path) for n in range(2)]
    try:
        wait_until(lambda: sum(e.event == "done" for e in events(log_path)) >= 100, 120,
                   "the consumers to handle 100 messages")
        leaders = collections.Counter(cluster.leaders(topic).values())
        [(victim, _)] = leaders.most_common(1)
        cluster.kill(victim)
        killed_at = time.monotonic()
        handled_at_kill = {e.id for e in events(log_path) if e.event == "done"}
        wait_until(lambda: ids <= {e.id for e in events(log_path) if e.event == "done"}, 240,
                   f"every message to be handled with node {victim} dead")
        finished_after = time.monotonic() - killed_at
    finally:
        for consumer in consumers:
            consumer.signal(signal.SIGTERM)
        codes = [consumer.wait(60) for consumer in consumers]
    assert codes == [0, 0], "".join(consumer.log() for consumer in consumers)
    done = collections.Counter(e.id for e in events(log_path) if e.event == "done")
    assert set(done) == ids, "none lost"
    deliveries = collections.Counter((e.id, e.delivery) for e in events(log_path) if e.event == "done")
    same_delivery = [key for key, count in deliveries.items() if count > 1]
    print(f"\nnode {victim} (leading {leaders[victim]} of the queue's partitions) killed after "
          f"{len(handled_at_kill)} of {MESSAGES} messages; the rest handled {finished_after:.1f} s later; "
          f"{sum(count > 1 for count in done.values())} handled twice ({len(same_delivery)} with the same "
          f"delivery count)")
