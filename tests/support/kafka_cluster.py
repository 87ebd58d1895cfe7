"""The Kafka cluster layouts of `bin/services` (`--brokers 3`, `--secure`), as tests use them.

`bin/services up --brokers 3 [--secure]` starts (or finds) the cluster and writes its client
settings to `.services/<layout>/client.env`; this module reads them and adds what fault tests
need: node processes to kill, pause and restart (restarting is `bin/services up` again, which
starts whichever nodes are down), partition leaders, group coordinators and the active controller.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import ElectionType, KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from tests.support.harness import wait_until

ROOT = Path(__file__).resolve().parents[2]
#: The tests' own admin clients log nowhere: a killed broker is the point, not news.
QUIET = logging.getLogger("tests.support.kafka_cluster.librdkafka")
QUIET.addHandler(logging.NullHandler())
QUIET.propagate = False
SERVICES = ROOT / "bin" / "services"
#: What a group coordinator answers while __consumer_offsets is being created or loaded (retried).
LOADING = {KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.COORDINATOR_NOT_AVAILABLE,
           KafkaError._TIMED_OUT}  # a fresh cluster on a loaded machine may not answer the first request in time
#: client.env's variables and the librdkafka settings they stand for (the example project reads the same).
CLIENT_SETTINGS = {
    "KAFKA_SECURITY_PROTOCOL": "security.protocol",
    "KAFKA_SASL_MECHANISM": "sasl.mechanism",
    "KAFKA_SASL_USERNAME": "sasl.username",
    "KAFKA_SASL_PASSWORD": "sasl.password",
    "KAFKA_SSL_CA_LOCATION": "ssl.ca.location",
}


@dataclass(frozen=True)
class Node:
    number: int
    home: Path

    @property
    def pid_file(self) -> Path:
        return self.home / "kafka.pid"

    @property
    def log_file(self) -> Path:
        return self.home / "kafka.log"

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return None
        return pid if str(self.home / "server.properties").encode() in cmdline else None


class Cluster:
    """One layout of `bin/services`: `Cluster(3)` is `--brokers 3`, `Cluster(3, secure=True)` adds `--secure`,
    `Cluster(1, spare=True)` is `--spare` (a single broker of its own, to stop and start again)."""

    def __init__(self, brokers: int, *, secure: bool = False, spare: bool = False) -> None:
        self.brokers = brokers
        self.secure = secure
        self.flags = [*(["--brokers", str(brokers)] if brokers != 1 else []), *(["--secure"] if secure else []),
                      *(["--spare"] if spare else [])]
        self.home = ROOT / ".services" / ("kafka" + ("-3" if brokers == 3 else "") + ("-secure" if secure else "")
                                          + ("-spare" if spare else ""))
        self.nodes = {n: Node(n, self.home / f"node-{n}") for n in range(1, brokers + 1)}
        #: Whether this session started the cluster (then it stops it at the end); None before start().
        self.started_here: bool | None = None
        #: Stopped by the session once its tests were done (tests/conftest.py); started again if one comes after all.
        self.stopped_early = False

    # -- lifecycle --------------------------------------------------------------------------------

    def services(self, command: str, *flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(SERVICES), command, *flags], text=True, capture_output=True,
                              env=dict(os.environ), timeout=600)

    def start(self) -> None:
        """The session's start: remember whether the cluster was already running, to leave it so."""
        self.started_here = not all(node.pid() is not None for node in self.nodes.values())
        self.up()

    def up(self) -> None:
        """Start the cluster, or whichever of its nodes are down, and wait until all brokers answer."""
        # --kafka-only: the session's Postgres (an external DATABASE_URL too) is not this fixture's to touch.
        result = self.services("up", *self.flags, "--kafka-only")
        if result.returncode != 0:
            raise RuntimeError(f"bin/services up {' '.join(self.flags)} failed: "
                               f"{(result.stderr or result.stdout).strip()}")
        wait_until(lambda: len(self.broker_ids()) == self.brokers, 120, f"{self.brokers} brokers in the metadata")

    def down(self) -> None:
        self.services("down", *self.flags)

    def heal(self) -> None:
        """Undo a test's faults: resume paused nodes, restart dead ones, wait for every replica to be in sync."""
        for node in self.nodes.values():
            pid = node.pid()
            if pid is not None:
                os.kill(pid, signal.SIGCONT)
        if any(node.pid() is None for node in self.nodes.values()):
            self.up()
        wait_until(self.all_in_sync, 120, "every partition's replicas back in sync")
        self.balance()

    def balance(self) -> None:
        """Give every partition back to its preferred leader, as Kafka itself does every 5 minutes."""
        admin = self.admin()
        try:
            admin.elect_leaders(ElectionType.PREFERRED, None).result(timeout=30)
        except KafkaException:
            pass  # "election not needed" for some partitions is reported as an error
        wait_until(self.balanced, 60, "every partition led by its preferred replica")

    def balanced(self) -> bool:
        metadata = self.admin().list_topics(timeout=5)
        return all(p.leader == p.replicas[0] for t in metadata.topics.values() for p in t.partitions.values())

    # -- faults -----------------------------------------------------------------------------------

    def pid(self, number: int) -> int:
        pid = self.nodes[number].pid()
        assert pid is not None, f"node {number} is not running"
        return pid

    def kill(self, number: int) -> float:
        """SIGKILL a node; returns the wall-clock time of the kill."""
        pid = self.pid(number)
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: self.nodes[number].pid() is None, 30, f"node {number} to die")
        return killed_at

    def stop(self, number: int) -> float:
        """SIGTERM a node, as a routine restart does, and wait until it has shut down; returns when it was asked."""
        pid = self.pid(number)
        stopped_at = time.time()
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: self.nodes[number].pid() is None, 60, f"node {number} to shut down")
        return stopped_at

    def pause(self, number: int) -> float:
        """SIGSTOP a node: its sockets stay open and nothing answers, as when a host is cut off."""
        paused_at = time.time()
        os.kill(self.pid(number), signal.SIGSTOP)
        return paused_at

    def resume(self, number: int) -> None:
        os.kill(self.pid(number), signal.SIGCONT)

    # -- clients ----------------------------------------------------------------------------------

    def environment(self) -> dict[str, str]:
        """client.env: KAFKA_BOOTSTRAP_SERVERS and, when secure, the KAFKA_SASL_* and KAFKA_SSL_* variables."""
        values = {}
        for line in (self.home / "client.env").read_text().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.partition("=")
                values[name] = value
        return values

    @property
    def bootstrap_servers(self) -> str:
        return self.environment()["KAFKA_BOOTSTRAP_SERVERS"]

    @property
    def password(self) -> str:
        return self.environment()["KAFKA_SASL_PASSWORD"]

    def client_config(self, **overrides: Any) -> dict[str, Any]:
        """librdkafka settings for this cluster (bootstrap servers, and security when secure)."""
        env = self.environment()
        config: dict[str, Any] = {"bootstrap.servers": env["KAFKA_BOOTSTRAP_SERVERS"]}
        config.update({key: env[name] for name, key in CLIENT_SETTINGS.items() if name in env})
        config.update(overrides)
        return config

    def admin(self) -> AdminClient:
        return AdminClient(self.client_config(logger=QUIET))

    def broker_ids(self) -> set[int]:
        try:
            return set(self.admin().list_topics(timeout=5).brokers)
        except Exception:
            return set()

    def create_topic(self, prefix: str, partitions: int = 3, leader: int | None = None,
                     config: dict[str, str] | None = None) -> str:
        """A topic replicated on every node; with `leader`, that node is the preferred leader of every partition."""
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        if leader is None:
            topic = NewTopic(name, num_partitions=partitions, replication_factor=min(3, self.brokers),
                             config=config or {})
        else:
            others = [n for n in self.nodes if n != leader]
            assignment = [[leader, *others[p % len(others):], *others[:p % len(others)]] for p in range(partitions)]
            topic = NewTopic(name, num_partitions=partitions, replica_assignment=assignment, config=config or {})
        admin = self.admin()  # kept alive until the future completes
        admin.create_topics([topic])[name].result(timeout=30)
        wait_until(lambda: self.leaders(name) and all(self.leaders(name).values()), 30, f"leaders for {name}")
        return name

    def leaders(self, topic: str) -> dict[int, int]:
        """Partition -> id of the node leading it (-1 while none does)."""
        metadata = self.admin().list_topics(topic, timeout=10).topics.get(topic)
        if metadata is None or metadata.error is not None:
            return {}
        return {p: part.leader for p, part in metadata.partitions.items()}

    def coordinator(self, group: str) -> int:
        """The node coordinating a consumer group (Kafka picks it from the group id, existing or not)."""
        admin = self.admin()

        def ask() -> int | None:
            try:
                return admin.describe_consumer_groups([group], request_timeout=10)[group].result().coordinator.id
            except KafkaException as error:
                if error.args[0].retriable() or error.args[0].code() in LOADING:
                    return None  # a fresh cluster is still creating or loading __consumer_offsets, or slow to answer
                raise

        return wait_until(ask, 60, f"a coordinator for group {group}")

    def active_controller(self) -> int:
        """The KRaft quorum's leader, as the nodes' quorum-state files record it."""
        for node in self.nodes.values():
            state = node.home / "data" / "__cluster_metadata-0" / "quorum-state"
            if node.pid() is not None and state.exists():
                leader = json.loads(state.read_text()).get("leaderId", -1)
                if leader > 0:
                    return leader
        raise AssertionError("no node records a quorum leader")

    def all_in_sync(self, topics: Sequence[str] | None = None) -> bool:
        """Every partition (of `topics`, or of every topic) has a leader and all its replicas in sync."""
        try:
            metadata = self.admin().list_topics(timeout=5)
        except Exception:
            return False
        if len(metadata.brokers) != self.brokers:
            return False
        for name, topic in metadata.topics.items():
            if topics is not None and name not in topics:
                continue
            for partition in topic.partitions.values():
                if partition.leader < 0 or sorted(partition.isrs) != sorted(partition.replicas):
                    return False
        return True
