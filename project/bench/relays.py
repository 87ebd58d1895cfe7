"""What the side-by-side benchmark runs and watches: a relay as a process of its own (the harvester, or a peer
such as Debezium's Kafka Connect worker), the consumer that notes when each record arrives, and the CPU of a
database role's server processes (a relay's own sessions: the harvester's, Debezium's walsender).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import psutil
import psycopg
from confluent_kafka import Consumer, KafkaError, TopicPartition

ROOT = Path(__file__).resolve().parents[2]


class Relay:
    """A relay process: started, waited on until it publishes, stopped; its CPU and peak RSS sampled (children
    included). Subclasses say how to start it and which header carries the outbox id."""

    name = "relay"
    #: The database role its sessions log in as (their server processes are its own cost).
    role = ""
    #: The message header that carries the outbox row's id.
    id_header = ""

    def __init__(self, log_file: Path) -> None:
        self.log_file = log_file
        self.process: subprocess.Popen[bytes] | None = None
        #: Where this start's output begins in the log (earlier starts' lines come before it).
        self.log_offset = 0
        self.peak_rss = 0
        self._done = threading.Event()
        self._cpu_seen: dict[int, float] = {}

    def command(self) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError

    def start(self) -> float:
        """Start the process; returns the moment it was started (time.time())."""
        args, env = self.command()
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self.log_offset = log.tell()
            started = time.time()
            self.process = subprocess.Popen(args, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=ROOT, start_new_session=True)
        self.peak_rss = 0
        self._cpu_seen = {}
        self._done = threading.Event()
        threading.Thread(target=self._sample, daemon=True, name=f"{self.name}-sampler").start()
        return started

    def _tree(self) -> list[psutil.Process]:
        root = psutil.Process(self.process.pid)
        return [root, *root.children(recursive=True)]

    def _sample(self) -> None:
        while not self._done.is_set():
            try:
                tree = self._tree()
                self.peak_rss = max(self.peak_rss, sum(p.memory_info().rss for p in tree))
                for p in tree:
                    times = p.cpu_times()
                    self._cpu_seen[p.pid] = times.user + times.system
            except psutil.Error:
                pass
            self._done.wait(0.1)

    def cpu(self) -> float:
        """CPU seconds of the process and its children since it started (children that exited meanwhile as last
        sampled)."""
        try:
            for p in self._tree():
                times = p.cpu_times()
                self._cpu_seen[p.pid] = times.user + times.system
        except psutil.Error:
            pass
        return sum(self._cpu_seen.values())

    def reset_peak(self) -> None:
        self.peak_rss = 0

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 60) -> None:
        if self.process is None:
            return
        self._done.set()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def log(self) -> str:
        """This start's output so far."""
        try:
            with open(self.log_file, "rb") as log:
                log.seek(self.log_offset)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 5) -> str:
        return " | ".join(self.log().strip().splitlines()[-lines:])


class HarvesterRelay(Relay):
    """`manage.py harvest` on the benchmark's database (through DATABASE_URL), with a leader topic of its own."""

    name = "harvester"
    id_header = "outbox-id"

    def __init__(self, log_file: Path, dsn: str, role: str, bootstrap: str, args: Sequence[str] = ()) -> None:
        super().__init__(log_file)
        self.dsn, self.role, self.bootstrap, self.args = dsn, role, bootstrap, list(args)

    def command(self) -> tuple[list[str], dict[str, str]]:
        leader = f"bench-side-leader-{uuid.uuid4().hex[:8]}"
        return ([sys.executable, str(ROOT / "manage.py"), "harvest", "--leader-topic", leader, "--leader-group", leader,
                 "--name", "bench-side", *self.args],
                {"DATABASE_URL": self.dsn, "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap})

    def led(self) -> bool:
        return "Leading with leader id" in self.log()


class Receiver(threading.Thread):
    """Reads a topic from its start and notes when each outbox id first arrived (time.time()), polling one
    message at a time (a batch would add its own wait to every record's latency)."""

    def __init__(self, bootstrap: str, topic: str, id_header: str) -> None:
        super().__init__(daemon=True, name=f"receiver-{topic}")
        self.bootstrap, self.topic, self.id_header = bootstrap, topic, id_header
        self.received: dict[int, float] = {}
        self.messages = 0
        self.stopping = threading.Event()
        self.assigned = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": f"bench-side-{uuid.uuid4().hex}",
                             "enable.auto.commit": False, "auto.offset.reset": "earliest",
                             "fetch.wait.max.ms": 10, "enable.partition.eof": False})
        try:
            try:
                partitions = self._partitions(consumer)
            except RuntimeError as error:
                self.error = str(error)
                self.assigned.set()
                return
            consumer.assign([TopicPartition(self.topic, p, 0) for p in partitions])
            self.assigned.set()
            header = self.id_header
            while not self.stopping.is_set():
                message = consumer.poll(0.2)
                if message is None:
                    continue
                now = time.time()
                if message.error():
                    if message.error().code() != KafkaError._PARTITION_EOF:
                        self.error = message.error().str()
                    continue
                self.messages += 1
                for name, value in message.headers() or []:
                    if name == header:
                        self.received.setdefault(int(value), now)
                        break
        finally:
            consumer.close()

    def _partitions(self, consumer: Consumer, timeout: float = 30) -> list[int]:
        """The topic's partitions once each has a leader: just after its creation, the metadata may not list
        them yet (assigning none would wait for nothing)."""
        deadline = time.monotonic() + timeout
        while True:
            found = consumer.list_topics(self.topic, timeout=10).topics.get(self.topic)
            if (found is not None and found.error is None and found.partitions
                    and all(p.leader >= 0 and p.error is None for p in found.partitions.values())):
                return sorted(found.partitions)
            if time.monotonic() > deadline:
                raise RuntimeError(f"topic {self.topic} has no partitions with leaders after {timeout:.0f} s")
            time.sleep(0.1)

    def wait_for(self, count: int, timeout: float, relay: Relay | None = None) -> bool:
        """Until `count` distinct ids arrived (True), the timeout passed or the relay exited (False)."""
        deadline = time.monotonic() + timeout
        while len(self.received) < count:
            if time.monotonic() > deadline or (relay is not None and not relay.alive()) or self.error:
                return False
            time.sleep(0.02)
        return True

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=10)


class RoleCpu:
    """CPU seconds of a role's server processes over a stretch of time: sampled every 0.2 s, so sessions that
    began meanwhile count from their start and those that ended count up to their last sample."""

    def __init__(self, superuser_dsn: str, role: str) -> None:
        self.dsn, self.role = superuser_dsn, role
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _pids(self, conn: psycopg.Connection) -> list[int]:
        return [pid for (pid,) in conn.execute("SELECT pid FROM pg_stat_activity WHERE usename = %s", [self.role])]

    def _sample(self, conn: psycopg.Connection, first: bool) -> None:
        for pid in self._pids(conn):
            try:
                times = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            used = times.user + times.system
            if first:
                self._first[pid] = used
            self._first.setdefault(pid, 0.0)
            self._last[pid] = used

    def start(self) -> None:
        self._first, self._last = {}, {}
        self._stop.clear()
        conn = psycopg.connect(self.dsn, autocommit=True)
        self._sample(conn, first=True)

        def sample() -> None:
            try:
                while not self._stop.wait(0.2):
                    self._sample(conn, first=False)
                self._sample(conn, first=False)
            finally:
                conn.close()
        self._thread = threading.Thread(target=sample, daemon=True, name=f"cpu-{self.role}")
        self._thread.start()

    def stop(self) -> float:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        return sum(self._last[pid] - self._first[pid] for pid in self._last)
