"""Harvesting on a three-node Kafka cluster (`bin/services up --brokers 3`) while brokers fail.

Topics are replicated three times with min.insync.replicas=2 and the record producer uses
acks=all with idempotence (its defaults), so Kafka promises that an acknowledged write survives
the loss of one node. These tests check the harvester's side of it, with a real consumer reading
the topic throughout: nothing lost, no record after a later one of its key (one-off repeats
allowed), the table drains, no replica crashes, and never two replicas publishing at once.

Each test prints what it measured (run with -s): how long consumers saw nothing new after the
fault, and when records flowed again. docs/kafka.md quotes these figures.

Slow: each waits out Kafka's own fail-over (a new partition leader, the controller's election, a cut-off
leader's session timeout) under load, then for every replica back in sync.
"""

from __future__ import annotations

import re
import signal
import time
import uuid
from datetime import datetime
from itertools import groupby

import pytest

from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.connector import LiveConnector
from outbox.harvest.harvester import Harvester, HarvestError
from outbox.harvest.kafka import record_producer_config
from tests.support.harness import (
    Generator,
    RecordingProducer,
    Replica,
    TopicTail,
    assert_complete_and_ordered,
    outbox_count,
    replica_env,
    wait_until,
)
from tests.support.kafka_cluster import Cluster

# Kafka's brokers killed and paused: the same on any PostgreSQL server (not in make test-postgres18)
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.django_db(transaction=True),
              pytest.mark.postgres_agnostic]

#: Record topics stamp messages with the broker's append time: deliveries of two replicas can be ordered.
APPEND_TIME = {"message.timestamp.type": "LogAppendTime"}
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


@pytest.fixture
def cluster(kafka_cluster: Cluster):
    """The three-node cluster, every node up, in sync and leading its preferred partitions, before and after."""
    kafka_cluster.heal()
    yield kafka_cluster
    kafka_cluster.heal()


def group_coordinated_by(cluster: Cluster, node: int) -> str:
    """A consumer group name whose coordinator is `node` (Kafka hashes the name onto __consumer_offsets)."""
    for _ in range(100):
        group = f"group-{uuid.uuid4().hex[:10]}"
        if cluster.coordinator(group) == node:
            return group
    raise AssertionError(f"no group name found whose coordinator is node {node}")


def start_replicas(cluster: Cluster, database_url: str, leader_topic: str, group: str, tmp_path,
                   count: int = 2) -> list[Replica]:
    """`manage.py harvest` replicas configured for the cluster through the environment only."""
    env = {**replica_env(database_url, cluster.bootstrap_servers, leader_topic), **cluster.environment(),
           "OUTBOX_LEADER_GROUP": group}
    return [Replica(f"replica-{i}", env, tmp_path) for i in range(count)]


#: Log lines that start and end a term. Status rows say who leads now; overlaps in the past are in the logs.
LEADING = re.compile(r"Leading with leader id|Refreshed leader id")
NOT_LEADING = re.compile(r"Fenced|revoked|lost|Stopped|another replica holds")


def leadership_terms(replica: Replica) -> list[tuple[float, float]]:
    """(start, end) wall-clock times during which the replica's log says it led (end: now if still leading)."""
    terms, start = [], None
    for line in replica.log().splitlines():
        match = LOG_TIME.match(line)
        if not match:
            continue
        when = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if LEADING.search(line) and start is None:
            start = when
        elif NOT_LEADING.search(line) and start is not None:
            terms.append((start, when))
            start = None
    if start is not None:
        terms.append((start, time.time()))
    return terms


def assert_one_leader_at_a_time(replicas: list[Replica]) -> None:
    terms = [(r.name, start, end) for r in replicas for start, end in leadership_terms(r)]
    for i, (name, start, end) in enumerate(terms):
        for other, other_start, other_end in terms[i + 1:]:
            if other != name:
                assert end <= other_start or other_end <= start, \
                    f"{name} led {start:.3f}-{end:.3f} while {other} led {other_start:.3f}-{other_end:.3f}"


def assert_no_crash(replicas: list[Replica]) -> None:
    for replica in replicas:
        assert replica.process.poll() is None, f"{replica.name} exited:\n{replica.log()[-3000:]}"
        assert "Traceback" not in replica.log(), f"{replica.name} logged a traceback:\n{replica.log()[-3000:]}"


def stop_all(replicas: list[Replica]) -> list[int]:
    for replica in replicas:
        replica.signal(signal.SIGTERM)
    return [replica.wait(timeout=60) for replica in replicas]


def report(what: str, **figures: object) -> None:
    """The figures a test saw (pytest -s shows them; docs/kafka.md quotes them)."""
    print(f"\n{what}: " + ", ".join(f"{name.replace('_', ' ')} {value}" for name, value in figures.items()))


def harvest_under_fault(cluster: Cluster, database_url: str, tmp_path, *, leader_topic_on: int, records_on: int,
                        victim: int, group_on: int | None = None) -> None:
    """Two `manage.py harvest` replicas and a steady load; SIGKILL node `victim` mid-way, then restart it."""
    controller_at_start = cluster.active_controller()
    leader_topic = cluster.create_topic("leader", partitions=1, leader=leader_topic_on)
    group = group_coordinated_by(cluster, group_on) if group_on else leader_topic
    topic = cluster.create_topic("records", partitions=3, leader=records_on, config=APPEND_TIME)
    replicas = start_replicas(cluster, database_url, leader_topic, group, tmp_path)
    tail = TopicTail(cluster.bootstrap_servers, topic, cluster.client_config())
    generator = Generator(topic, pause=0.05)  # about 400 records/s: a steady load the harvester keeps up with
    try:
        tail.start()
        wait_until(lambda: any(r.is_leading() for r in replicas), 60, "a leader")
        generator.start()
        wait_until(lambda: tail.audit.messages > 1000, 60, "harvesting under way")
        newest = max(generator.ids)
        killed_at = cluster.kill(victim)
        wait_until(lambda: sum(record_id > newest for _, record_id in tail.arrivals) > 1000, 90,
                   f"records stashed after the kill to flow with node {victim} dead")
        cluster.up()  # bin/services up --brokers 3 restarts the dead node
        wait_until(lambda: cluster.all_in_sync([topic, leader_topic]), 120, f"node {victim} back in sync")
        stashed = generator.stop()
        wait_until(lambda: outbox_count(database_url) == 0, 120, "the outbox to drain")
        wait_until(lambda: tail.has(stashed), 60, "the consumer to see every record")
        assert_no_crash(replicas)
        assert_one_leader_at_a_time(replicas)
    finally:
        generator.halt.set()
        codes = stop_all(replicas)
        audit = tail.stop()
    assert codes == [0, 0], "both replicas stop gracefully on SIGTERM"
    assert_complete_and_ordered(audit, stashed)
    controller = " (the controller)" if victim == controller_at_start else ""
    report(f"SIGKILL node {victim}{controller} (leader topic on {leader_topic_on}, election group on "
           f"{group_on or '?'}, records on {records_on})",
           new_records_reached_consumers_after=f"{tail.first_arrival_after(killed_at, newest):.1f}s",
           messages=audit.messages, repeats=audit.duplicates,
           fenced=sum(r.log().count("Fenced:") for r in replicas),
           failed_delivery_batches=sum(r.log().count("Delivery failed") for r in replicas))


def test_broker_leading_the_records_killed_and_restarted(cluster, database_url, tmp_path):
    """The node leading every partition of the record topic dies (not the leader topic's nor the group's)."""
    harvest_under_fault(cluster, database_url, tmp_path, leader_topic_on=1, group_on=1, records_on=3, victim=3)


def test_controller_holding_the_leader_topic_killed(cluster, database_url, tmp_path):
    """The active KRaft controller dies, and it leads the leader topic's partition and coordinates the group."""
    victim = cluster.active_controller()
    harvest_under_fault(cluster, database_url, tmp_path, leader_topic_on=victim, group_on=victim,
                        records_on=next(n for n in cluster.nodes if n != victim), victim=victim)


def test_broker_cut_off_leader_fences_itself_and_never_two_publish(cluster, database_url):
    """SIGSTOP the active controller, which also leads the leader topic, coordinates the group and leads the
    records: it answers nothing and its sockets stay open. The leader stops seeing its heartbeats and fences
    itself; harvesting resumes once the other two have elected a controller and moved the partitions; and by
    the brokers' own append times, no two replicas' deliveries ever interleave."""
    victim = cluster.active_controller()
    leader_topic = cluster.create_topic("leader", partitions=1, leader=victim)
    group = group_coordinated_by(cluster, victim)
    topic = cluster.create_topic("records", partitions=3, leader=victim, config=APPEND_TIME)
    deliveries: list[tuple[float, str, float, int]] = []
    events: list[tuple[float, str, str]] = []

    def harvester(name: str) -> Harvester:
        class Recording(LiveConnector):
            def record_producer(self) -> RecordingProducer:
                return RecordingProducer(record_producer_config(self.config), name, deliveries)

        config = HarvestConfig(dsn=database_url, base_kafka_config=cluster.client_config(), leader_topic=leader_topic,
                               leader_group=group, name=name, limits=Limits(status_interval=0))
        return Harvester(config, connector=Recording(config),
                         on_event=lambda event: events.append((time.time(), name, type(event).__name__)))

    harvesters = [harvester("cut-a"), harvester("cut-b")]
    tail = TopicTail(cluster.bootstrap_servers, topic, cluster.client_config())
    generator = Generator(topic, pause=0.05)  # about 400 records/s: a steady load the harvester keeps up with
    paused = False
    try:
        tail.start()
        for each in harvesters:
            each.start()
        wait_until(lambda: any(h.is_leader for h in harvesters), 60, "a leader")
        leader = next(h for h in harvesters if h.is_leader).config.name
        generator.start()
        wait_until(lambda: tail.audit.messages > 1000, 60, "harvesting under way")
        newest = max(generator.ids)
        paused_at = cluster.pause(victim)
        paused = True
        status = cluster.services("status", *cluster.flags).stdout
        assert f"node {victim}: paused (SIGSTOP)" in status, status
        fenced_at = wait_until(lambda: next((t for t, n, e in events if n == leader and e == "LeaderFenced"
                                             and t > paused_at), None), 30, f"{leader} to fence itself")
        wait_until(lambda: sum(record_id > newest for *_, record_id in deliveries) > 1000, 90,
                   f"records stashed after the pause to be published with node {victim} cut off")
        resumed_at = min(acked for _, _, acked, record_id in deliveries if record_id > newest)
        cluster.resume(victim)
        paused = False
        cut_off_for = time.time() - paused_at
        stashed = generator.stop()
        wait_until(lambda: outbox_count(database_url) == 0, 120, "the outbox to drain")
        wait_until(lambda: tail.has(stashed), 60, "the consumer to see every record")
        assert all(h.state.value == "running" for h in harvesters), "a cut-off broker is survived, not fatal"
    finally:
        generator.halt.set()
        if paused:
            cluster.resume(victim)
        for each in harvesters:
            each.stop()
        failures = []
        for each in harvesters:
            try:
                each.wait(timeout=60)  # re-raises a background failure
            except HarvestError as error:
                failures.append(f"{each.config.name}: {error}")
        audit = tail.stop()
    assert not failures, f"a cut-off broker is survived, not fatal: {failures}"
    assert_complete_and_ordered(audit, stashed)
    acquisitions = [name for _, name, event in sorted(events) if event in {"LeaderAcquired", "LeaderRefreshed"}]
    handovers = sum(1 for _ in groupby(acquisitions)) - 1
    runs = [name for name, _ in groupby(name for _, name, *_ in sorted(deliveries))]
    assert len(runs) - 1 <= handovers, \
        f"deliveries of two replicas interleaved: runs {runs} with {handovers} handover(s) of leadership"
    transitions = [f"{n} {e.removeprefix('Leader').lower()} +{t - paused_at:.1f}s" for t, n, e in events
                   if t > paused_at and e != "MeterRead"]
    report(f"SIGSTOP node {victim} (the controller; leader topic, election group and records on it) for "
           f"{cut_off_for:.0f}s", leader_fenced_after=f"{fenced_at - paused_at:.1f}s",
           new_records_published_after=f"{resumed_at - paused_at:.1f}s", messages=audit.messages,
           repeats=audit.duplicates, transitions=transitions)
