"""Harvesting against real Postgres and Kafka, after goharvest's own integration tests.

A generator stashes keyed records in transactions of 20 over 10 keys while harvesters run;
a consumer then checks that every record arrived and that, per key, outbox ids never go
backwards (one-off repeats allowed). The table is empty at the end.
"""

from __future__ import annotations

import signal
import time
import uuid

import pytest

from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.connector import LiveConnector
from outbox.harvest.harvester import Harvester
from outbox.harvest.kafka import record_producer_config
from tests.support.harness import (
    FaultyProducer,
    FaultyStore,
    Generator,
    Replica,
    assert_complete_and_ordered,
    outbox_count,
    read_topic,
    replica_env,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def config_for(database_url: str, bootstrap: str, **limits: float) -> HarvestConfig:
    leader = f"test-leader-{uuid.uuid4().hex[:8]}"
    return HarvestConfig(dsn=database_url, base_kafka_config={"bootstrap.servers": bootstrap}, leader_topic=leader,
                         leader_group=leader, name="in-process",
                         limits=Limits(**{"heartbeat_timeout": 2.0, "min_metrics_interval": 1.0, **limits}))


@pytest.mark.parametrize("per_key", [1, 256], ids=["one-per-key", "pipelined"])
def test_one_replica_with_injected_failures(database_url, bootstrap_servers, new_topic, per_key):
    """With one record per key in flight a failure repeats at most that record (strict order); with
    several, a repeated run of records already published is allowed, a first publication out of order never."""
    topic = new_topic("harvest-faults")
    faults: dict[str, object] = {}

    class Faulty(LiveConnector):
        def record_producer(self):
            faults["producer"] = FaultyProducer(record_producer_config(self.config), fail_delivery=0.02,
                                                refuse=0.01, seed=7)
            return faults["producer"]

        def open_store(self):
            faults["store"] = FaultyStore(super().open_store(), fail_mark=0.05, fail_purge=0.02, seed=11)
            return faults["store"]

    events = []
    config = config_for(database_url, bootstrap_servers, max_in_flight_per_key=per_key)
    harvester = Harvester(config, on_event=events.append, connector=Faulty(config))
    generator = Generator(topic, limit=3000)
    harvester.start()
    try:
        generator.start()
        wait_until(lambda: len(generator.ids) >= 3000, 120, "3000 records stashed")
        stashed = generator.stop()
        wait_until(lambda: outbox_count(database_url) == 0, 120, "the outbox to drain")
    finally:
        harvester.stop()
        harvester.wait(timeout=30)
    audit = read_topic(bootstrap_servers, topic, expected=len(stashed))
    assert_complete_and_ordered(audit, stashed, strict=per_key == 1)
    assert faults["producer"].injected > 10, "deliveries failed"
    assert faults["store"].marks_failed and faults["store"].purges_failed, "marks and purges failed"
    refreshed = [e for e in events if type(e).__name__ == "LeaderRefreshed"]
    assert refreshed, "failed deliveries and marks forced remarks under new leader ids"
    leader_ids = [e.leader_id for e in events if hasattr(e, "leader_id")]
    assert len(leader_ids) == len(set(leader_ids)), "leader ids are never reused"


@pytest.mark.slow
def test_four_replicas_with_leaders_killed_repeatedly(database_url, bootstrap_servers, new_topic, tmp_path):
    """Slow: each kill waits for the session timeout and a new leader, several times over."""
    topic = new_topic("harvest-kills")
    env = replica_env(database_url, bootstrap_servers, f"test-leader-{uuid.uuid4().hex[:8]}")
    args = ["--heartbeat-timeout", "2", "--min-metrics-interval", "1"]
    replicas = [Replica(f"replica-{i}", env, tmp_path, args) for i in range(4)]
    generator = Generator(topic, pause=0.02)
    kills = [signal.SIGKILL, signal.SIGTERM, signal.SIGKILL, signal.SIGTERM]
    try:
        generator.start()
        for number, signum in enumerate(kills, start=4):
            leader = wait_until(lambda: next((r for r in replicas if r.is_leading()), None), 60, "a leader")
            time.sleep(2)  # let the leader get well into the backlog, records in flight
            leader.signal(signum)
            code = leader.wait(timeout=60)
            if signum == signal.SIGTERM:
                assert code == 0, f"graceful stop exits 0, got {code}:\n{leader.log()[-2000:]}"
            replicas.remove(leader)
            replicas.append(Replica(f"replica-{number}", env, tmp_path, args))
        stashed = generator.stop()
        wait_until(lambda: outbox_count(database_url) == 0, 120, "the outbox to drain after the last kill")
        # The last kill may have been moments ago: give the group a session timeout to settle on one leader.
        wait_until(lambda: [r for r in replicas if r.is_leading()] or None, 30, "a leader after the kills")
        wait_until(lambda: len([r for r in replicas if r.is_leading()]) == 1, 15,
                   "exactly one of the remaining replicas to lead")
    finally:
        generator.halt.set()
        for replica in replicas:
            replica.signal(signal.SIGTERM)
        for replica in replicas:
            replica.wait(timeout=60)
    audit = read_topic(bootstrap_servers, topic, expected=len(stashed))
    assert_complete_and_ordered(audit, stashed)
    assert len(stashed) > 1000


@pytest.mark.slow
def test_eight_replicas_without_failures(database_url, bootstrap_servers, new_topic, tmp_path):
    """Slow: eight harvester processes start, elect a leader and stop."""
    topic = new_topic("harvest-eight")
    env = replica_env(database_url, bootstrap_servers, f"test-leader-{uuid.uuid4().hex[:8]}")
    replicas = [Replica(f"replica-{i}", env, tmp_path, ["--heartbeat-timeout", "2"]) for i in range(8)]
    generator = Generator(topic, limit=4000)
    try:
        wait_until(lambda: any(r.is_leading() for r in replicas), 60, "a leader")
        generator.start()
        wait_until(lambda: len(generator.ids) >= 4000, 120, "4000 records stashed")
        stashed = generator.stop()
        wait_until(lambda: outbox_count(database_url) == 0, 120, "the outbox to drain")
        # A status row a moment stale on a loaded machine reads as no leader: ask until one answers.
        wait_until(lambda: len([r for r in replicas if r.is_leading()]) == 1, 15, "exactly one leader among eight")
    finally:
        generator.halt.set()
        for replica in replicas:
            replica.signal(signal.SIGTERM)
        codes = [replica.wait(timeout=60) for replica in replicas]
    assert codes == [0] * 8, "every replica stops gracefully on SIGTERM"
    audit = read_topic(bootstrap_servers, topic, expected=len(stashed))
    assert_complete_and_ordered(audit, stashed)
    # A stall of seconds on two loaded cores is a failure all the same: the leader fences itself or
    # gives up its acks, and a repeat is then correct. Otherwise there must be none.
    met = [r.name for r in replicas if "Giving up" in r.log() or "Fenced:" in r.log()]
    assert audit.duplicates == 0 or met, "no failures injected or met, so no repeats"


@pytest.mark.parametrize("shards", [1, 2], ids=["one-table", "sharded"])
def test_a_session_timeout_kafka_refuses_stops_the_harvester_in_one_line(database_url, bootstrap_servers, tmp_path,
                                                                          shards):
    """heartbeat_timeout 1 s makes a session timeout of 3 s, under the 6 s Kafka's brokers accept by default: the
    broker refuses every JoinGroup, which librdkafka would retry for ever while the replica stood by saying
    nothing. The harvester stops, naming the setting (and `check` warned of it: W007)."""
    env = replica_env(database_url, bootstrap_servers, f"test-leader-{uuid.uuid4().hex[:8]}")
    replica = Replica("too-short", env, tmp_path, ["--heartbeat-timeout", "1", "--shards", str(shards)])
    code = replica.wait(timeout=60)  # killed and reaped if it has not stopped by then
    log = replica.log()
    assert code == 1 and "Kafka refuses the leader group's session timeout, 3 x heartbeat_timeout" in log, log[-3000:]
    assert "set heartbeat_timeout to at least 2s" in log and "Traceback" not in log.split("CommandError")[-1], log
