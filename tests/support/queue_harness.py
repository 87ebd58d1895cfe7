"""Pieces for the queue's integration tests: settings on fresh topics, processes, the handlers' event log."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, ShareConsumer, TopicPartition

from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.harvester import Harvester
from outbox.queue import markers, store
from outbox.queue.config import QueueConfig
from outbox.queue.tracker import RedeliveryTracker
from project.settings import queue_names

ROOT = Path(__file__).resolve().parents[2]
#: Short timeouts keep the tests quick; consumers in subprocesses get them as flags.
REDELIVERY_TIMEOUT = 2.0
# Keep-alives well inside the timeout (the default is a third of it): on two loaded cores a marker
# can take a second, and a late one is a redelivery the product is right to make.
KEEP_ALIVE_INTERVAL = 0.25


def queue_settings(prefix: str, **extra: object) -> dict[str, object]:
    return {**queue_names(prefix), "partitions": 4, "markers_partitions": 2, "redelivery_timeout": REDELIVERY_TIMEOUT,
            "keep_alive_interval": KEEP_ALIVE_INTERVAL, "status_interval": 0.5, "poll_interval": 0.05, **extra}


def new_prefix() -> str:
    return f"mq-{uuid.uuid4().hex[:10]}"


@dataclass(frozen=True)
class Event:
    """One line a test handler wrote."""

    event: str
    queue: str
    id: str
    delivery: int
    pid: int


def events(path: Path) -> list[Event]:
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 5:  # a line being written is skipped until complete
            found.append(Event(parts[0], parts[1], parts[2], int(parts[3]), int(parts[4])))
    return found


def process_env(database_url: str, bootstrap: str, prefix: str, event_log: Path, mode: str = "quick") -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "DATABASE_URL": database_url,
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "OUTBOX_QUEUE_PREFIX": prefix,
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "LOG_LEVEL": "INFO",
        "PYTHONUNBUFFERED": "1",
        "QUEUE_TEST_LOG": str(event_log),
        "QUEUE_TEST_MODE": mode,
    })
    return env


def consumer_args(queue: str, *extra: str, handler: str = "tests.support.queue_handlers.record") -> list[str]:
    return ["--queue", queue, "--handler", handler, "--redelivery-timeout", str(REDELIVERY_TIMEOUT),
            "--keep-alive-interval", str(KEEP_ALIVE_INTERVAL), *extra]


def group_members(config: QueueConfig, group: str) -> int:
    """Members of a consumer group that hold partitions."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": config.base_kafka_config["bootstrap.servers"]})
    described = admin.describe_consumer_groups([group])[group].result(timeout=10)
    return sum(1 for member in described.members if member.assignment.topic_partitions)


@contextlib.contextmanager
def running_tracker(config: QueueConfig, name: str = "tracker") -> Iterator[RedeliveryTracker]:
    """A tracker in this process, storing dead letters in the test database."""
    tracker = RedeliveryTracker(config, dead_letters=store.store_dead_letters, name=name)
    tracker.start()
    try:
        yield tracker
    finally:
        tracker.stop()
        tracker.wait(timeout=30)


@contextlib.contextmanager
def running_harvester(database_url: str, bootstrap: str, tracer: Any = None) -> Iterator[Harvester]:
    """A harvester of the test database's outbox, so stash()ed messages reach the queue topic."""
    leader = f"test-leader-{uuid.uuid4().hex[:8]}"
    harvester = Harvester(HarvestConfig(dsn=database_url, base_kafka_config={"bootstrap.servers": bootstrap},
                                        leader_topic=leader, leader_group=leader, limits=Limits(heartbeat_timeout=2.0)),
                          tracer=tracer)
    harvester.start()
    try:
        yield harvester
    finally:
        harvester.stop()
        harvester.wait(timeout=30)


@dataclass(frozen=True)
class QueueRecord:
    key: str
    id: str
    deliveries: int
    payload: bytes


def read_queue_topic(bootstrap: str, topic: str, timeout: float = 30) -> list[QueueRecord]:
    """Every committed record of the queue topic, read to the end of each partition."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"audit-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "enable.partition.eof": True,
                         "isolation.level": "read_committed"})
    found: list[QueueRecord] = []
    try:
        partitions = list(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        at_end: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(at_end) < len(partitions):
            assert time.monotonic() < deadline, f"timed out reading {topic} to its end"
            for record in consumer.consume(500, timeout=0.5):
                if record.error():
                    assert record.error().code() == KafkaError._PARTITION_EOF, record.error()
                    at_end.add(record.partition())
                    continue
                headers = record.headers() or []
                found.append(QueueRecord(record.key().decode(), markers.header_text(headers, markers.ID_HEADER) or "",
                                         markers.deliveries_of(headers), record.value()))
    finally:
        consumer.close()
    return found


_support: dict[str, str | None] = {}


def share_groups_missing(bootstrap: str) -> str | None:
    """Why the broker at `bootstrap` cannot run share groups (None: it can): a consumer that joins and polls."""
    if bootstrap not in _support:
        consumer = ShareConsumer({"bootstrap.servers": bootstrap, "group.id": f"probe-{uuid.uuid4().hex[:8]}",
                                  "share.acknowledgement.mode": "explicit", "error_cb": lambda error: None})
        reason = None
        try:
            consumer.subscribe([f"probe-{uuid.uuid4().hex[:8]}"])
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                consumer.poll(0.5)
        except KafkaException as error:
            reason = error.args[0].str() if error.args else str(error)
        finally:
            try:
                consumer.close()
            except (KafkaException, RuntimeError):
                pass
        _support[bootstrap] = reason
    return _support[bootstrap]
