"""Pieces for end-to-end harvesting tests: a record generator, a topic checker, replica processes, faults."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from tests.support.waiting import wait_until as wait_until  # the tests' one wait, re-exported

ROOT = Path(__file__).resolve().parents[2]
#: librdkafka's log lines of the tests' own consumers go nowhere (brokers die on purpose here).
QUIET = logging.getLogger("tests.integration.librdkafka")
QUIET.addHandler(logging.NullHandler())
QUIET.propagate = False
#: The small_topic fixture's max.message.bytes (tests/conftest.py): a record twice this is refused.
SMALL_TOPIC_BYTES = 4096


#: goharvest's README, "1. Create an outbox table", as written there (its table name aside).
GOHARVEST_DDL = """
CREATE TABLE {table} (
  id                  BIGSERIAL PRIMARY KEY,
  create_time         TIMESTAMP WITH TIME ZONE NOT NULL,
  kafka_topic         VARCHAR(249) NOT NULL,
  kafka_key           VARCHAR(100) NOT NULL,
  kafka_value         VARCHAR(10000),
  kafka_header_keys   TEXT[] NOT NULL,
  kafka_header_values TEXT[] NOT NULL,
  leader_id           UUID
)"""


def outbox_count(database_url: str) -> int:
    with psycopg.connect(database_url) as conn:
        return conn.execute("SELECT count(*) FROM outbox").fetchone()[0]


class Generator(threading.Thread):
    """Stashes keyed records with stash_many() in transactions of `batch`, round-robin over `keys` keys.

    One thread, one transaction after another: per key, commit order is id order, which is the
    causal order the harvester must keep. Subclasses write another way (write(), close()).
    """

    def __init__(self, topic: str, *, keys: int = 10, batch: int = 20, pause: float = 0.01,
                 limit: int | None = None) -> None:
        super().__init__(name="generator", daemon=True)
        self.topic, self.keys, self.batch, self.pause, self.limit = topic, keys, batch, pause, limit
        self.ids: list[int] = []
        self.halt = threading.Event()
        self.failure: BaseException | None = None

    def write(self, records: list[dict[str, Any]]) -> list[int]:
        """One transaction of `records`; their ids."""
        from django.db import transaction

        from outbox import stash_many

        with transaction.atomic():
            return stash_many(records)

    def close(self) -> None:
        from django.db import connection

        connection.close()

    def run(self) -> None:
        sequence = 0
        try:
            while not self.halt.is_set() and (self.limit is None or len(self.ids) < self.limit):
                records = []
                for _ in range(self.batch):
                    records.append({"topic": self.topic, "key": f"key-{sequence % self.keys}",
                                    "value": f"value-{sequence}", "headers": [("seq", str(sequence))]})
                    sequence += 1
                self.ids.extend(self.write(records))
                if self.pause:
                    time.sleep(self.pause)
        except BaseException as error:
            self.failure = error
        finally:
            self.close()

    def stop(self) -> list[int]:
        self.halt.set()
        self.join(timeout=30)
        assert self.failure is None, f"generator failed: {self.failure!r}"
        return self.ids


@dataclass
class Audit:
    """What a topic holds, per key, in partition offset order."""

    by_key: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    messages: int = 0
    #: Each message's Kafka timestamp in seconds (the broker's append time on a LogAppendTime topic).
    timestamps: list[float] = field(default_factory=list)

    @property
    def ids(self) -> set[int]:
        return {i for ids in self.by_key.values() for i in ids}

    @property
    def duplicates(self) -> int:
        return self.messages - len(self.ids)

    def reversals(self, *, strict: bool = False) -> list[tuple[str, int, int]]:
        """(key, highest id before, id) for each id below an earlier one of its key. Not `strict`
        (several records of a key in flight): only an id published for the first time counts; a
        repeat of one already published is a duplicate, not a reversal."""
        found = []
        for key, ids in self.by_key.items():
            highest = 0
            seen: set[int] = set()
            for record_id in ids:
                if record_id < highest and (strict or record_id not in seen):
                    found.append((key, highest, record_id))
                highest = max(highest, record_id)
                seen.add(record_id)
        return found


def read_topic(bootstrap: str, topic: str, expected: int, timeout: float = 120,
               config: dict[str, Any] | None = None) -> Audit:
    """Read `topic` from the beginning until at least `expected` distinct outbox ids have arrived.

    `config` adds librdkafka settings, e.g. a secure cluster's security.protocol and sasl.*.
    """
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"audit-{uuid.uuid4().hex}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False, **(config or {})})
    audit = Audit()
    seen: set[int] = set()
    try:
        metadata = consumer.list_topics(topic, timeout=30)
        partitions = list(metadata.topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        deadline = time.monotonic() + timeout
        while len(seen) < expected and time.monotonic() < deadline:
            for message in consumer.consume(1000, timeout=1.0):
                if message.error():
                    if message.error().code() != KafkaError._PARTITION_EOF:
                        raise AssertionError(f"consumer error: {message.error()}")
                    continue
                record_id = int(dict(message.headers())["outbox-id"])
                audit.by_key[message.key().decode()].append(record_id)
                audit.messages += 1
                audit.timestamps.append(message.timestamp()[1] / 1000)
                seen.add(record_id)
    finally:
        consumer.close()
    return audit


class LiveConsumer(threading.Thread):
    """A consumer reading `topic` as it is published, through a topic's deletion and re-creation."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(name="live-consumer", daemon=True)
        self.audit = Audit()
        self._consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"live-{uuid.uuid4().hex}",
                                   "auto.offset.reset": "earliest", "enable.auto.commit": False,
                                   "topic.metadata.refresh.interval.ms": 1000})
        self._consumer.subscribe([topic])
        self.halt = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                for message in self._consumer.consume(1000, timeout=0.2):
                    if message.error():
                        continue  # a deleted topic's partitions come and go
                    record_id = int(dict(message.headers())["outbox-id"])
                    with self.lock:
                        self.audit.by_key[message.key().decode()].append(record_id)
                        self.audit.messages += 1
        finally:
            self._consumer.close()

    def seen(self) -> set[int]:
        with self.lock:
            return self.audit.ids

    def stop(self) -> Audit:
        self.halt.set()
        self.join(timeout=30)
        return self.audit


class TopicTail(threading.Thread):
    """A real consumer reading `topic` from the beginning while the test runs, noting when each message arrived.

    A consumer only sees what every in-sync replica has (the high watermark), so the arrival times
    show when records became visible downstream: the gap around a fault is the stall a user sees.
    """

    #: librdkafka's assigned consumer now and then fetches nothing more after its only broker restarted, though
    #: the partitions grow (confluentinc/librdkafka#5153, open): the harvester's records would look lost when only
    #: this downstream reader stopped. A tail that sees nothing for this long while a partition's high watermark is
    #: past what it read starts a new consumer at the offsets it had (as a user would restart a stuck one). Longer
    #: than librdkafka's own reconnect backoff (reconnect.backoff.max.ms, 10 s), so a consumer on its way back is
    #: never cut short and a fail-over's measured stall stays the one a user would see.
    STALLED_AFTER = 12.0

    def __init__(self, bootstrap: str, topic: str, config: dict[str, Any] | None = None) -> None:
        super().__init__(name=f"tail-{topic}", daemon=True)
        # librdkafka waits 60 s (socket.timeout.ms) on a request to a broker that hangs before it looks for
        # the partition's new leader; a consumer that waited that long would report a stall the harvester
        # never had. Ten seconds, as the harvester's own election clients.
        self._config = {"bootstrap.servers": bootstrap, "group.id": f"tail-{uuid.uuid4().hex}",
                        "auto.offset.reset": "earliest", "enable.auto.commit": False,
                        "socket.timeout.ms": 10_000, "logger": QUIET, **(config or {})}
        self._consumer = Consumer(self._config)
        self.topic = topic
        self.audit = Audit()
        #: (when it arrived, outbox id) for every message, in arrival order.
        self.arrivals: list[tuple[float, int]] = []
        self._seen: set[int] = set()
        #: The next offset to read, by partition.
        self._next: dict[int, int] = {}
        #: How often the consumer was started again after a stall (STALLED_AFTER).
        self.restarts = 0
        self._halt = threading.Event()
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            partitions = self._consumer.list_topics(self.topic, timeout=30).topics[self.topic].partitions
            self._next = dict.fromkeys(partitions, 0)
            self._assign()
            heard = asked = time.monotonic()
            while not self._halt.is_set():
                for message in self._consumer.consume(1000, timeout=0.2):
                    if message.error():
                        continue  # transient: a broker down is what these tests do
                    self._note(message)
                    heard = time.monotonic()
                now = time.monotonic()
                # No record for a while (error events, which a stuck consumer may go on returning, are none):
                # ask the broker, once a second at most, whether there was anything to read.
                if now - heard > self.STALLED_AFTER and now - asked >= 1.0:
                    asked = now
                    if self._behind():
                        self._consumer.close()
                        self._consumer = Consumer(self._config)
                        self._assign()
                        self.restarts += 1
                        heard = time.monotonic()
        except BaseException as error:
            self.failure = error
        finally:
            self._consumer.close()

    def _assign(self) -> None:
        self._consumer.assign([TopicPartition(self.topic, p, offset) for p, offset in self._next.items()])

    def _note(self, message: Any) -> None:
        now = time.time()
        record_id = int(dict(message.headers())["outbox-id"])
        self.audit.by_key[message.key().decode()].append(record_id)
        self.audit.messages += 1
        self.audit.timestamps.append(message.timestamp()[1] / 1000)
        self.arrivals.append((now, record_id))
        self._seen.add(record_id)
        self._next[message.partition()] = message.offset() + 1

    def _behind(self) -> bool:
        """Whether a partition's high watermark, asked of the broker, is past what this tail read (False while
        the broker does not answer: then nothing is stuck but the broker)."""
        try:
            return any(self._consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=2,
                                                            cached=False)[1] > offset
                       for p, offset in self._next.items())
        except KafkaException:
            return False

    def has(self, ids: Sequence[int]) -> bool:
        return self._seen.issuperset(ids)

    def stop(self) -> Audit:
        self._halt.set()
        self.join(timeout=30)
        assert self.failure is None, f"the consumer failed: {self.failure!r}"
        return self.audit

    def first_arrival_after(self, moment: float, newer_than: int) -> float:
        """Seconds from `moment` until a record with an id above `newer_than` (stashed after it) arrived."""
        return min(when for when, record_id in self.arrivals if record_id > newer_than) - moment


def assert_complete_and_ordered(audit: Audit, stashed: Sequence[int], *, strict: bool = False) -> None:
    """Every stashed id published, and no id published for the first time after a later id of its key.
    `strict` (one record per key in flight, goharvest's barrier): no id after a later one at all, repeats
    included."""
    missing = set(stashed) - audit.ids
    assert not missing, f"{len(missing)} stashed record(s) never published, e.g. {sorted(missing)[:5]}"
    reversals = audit.reversals(strict=strict)
    assert not reversals, f"{len(reversals)} per-key reversal(s), e.g. (key, seen, then) {reversals[:5]}"


class Process:
    """`manage.py <command> --name NAME ...` (or `program` `--name NAME ...`) in a subprocess, logging to its own
    file."""

    def __init__(self, name: str, command: str, args: Sequence[str], env: dict[str, str], log_dir: Path,
                 program: Sequence[str] | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in wait()
        program = [sys.executable, str(ROOT / "manage.py"), command] if program is None else program
        self.process = subprocess.Popen([*program, "--name", name, *args],
                                        cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def wait(self, timeout: float = 60) -> int:
        """Its exit status; one that has not exited within `timeout` is killed and reaped before the test fails
        (left running, it would be reported as a ResourceWarning in whichever test the worker runs next), having
        first printed where each of its threads waits (SIGUSR1, outbox/stopping.py) into its log, whose end the
        failure shows."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=2)  # the stacks written (it exits if it had no handler yet)
            self.process.kill()
            self.process.wait()
            print(f"{self.name} did not exit within {timeout:g}s; the end of its log:\n{self.log()[-8000:]}")
            raise
        finally:
            self._log.close()

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait()


class Replica(Process):
    """`manage.py harvest` in a subprocess; what it is doing is read from its status row, as the
    dashboard and the health probe read it."""

    STATUS_INTERVAL = 0.3

    def __init__(self, name: str, env: dict[str, str], log_dir: Path, args: Sequence[str] = (),
                 program: Sequence[str] | None = None) -> None:
        self.database_url = env["DATABASE_URL"]
        if "--status-interval" not in args:
            args = [*args, "--status-interval", str(self.STATUS_INTERVAL)]
        super().__init__(name, "harvest", args, env, log_dir, program)


    def state(self) -> str | None:
        """The state its status row reports, if the row is fresh (a frozen or dead replica's is not)."""
        if self.process.poll() is not None:
            return None
        with psycopg.connect(self.database_url) as conn:
            row = conn.execute("SELECT state, leader_id IS NOT NULL FROM outbox_harvester WHERE name = %s "
                               "AND last_seen > now() - make_interval(secs => %s)",
                               [self.name, 5 * self.STATUS_INTERVAL]).fetchone()
        if row is None:
            return None
        return row[0] if row[0] != "leader" or row[1] else "leader without a term"

    def is_leading(self) -> bool:
        return self.state() == "leader"


#: The stand-alone harvester (outbox-harvest) with Django made unimportable: it runs on the engine alone.
STANDALONE = [sys.executable, "-c", "import sys; sys.modules['django'] = None; from outbox.harvest.cli import main; "
                                    "sys.exit(main())"]


def replica_env(database_url: str, bootstrap: str, leader_topic: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "DATABASE_URL": database_url,
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "OUTBOX_LEADER_TOPIC": leader_topic,
        "OUTBOX_LEADER_GROUP": leader_topic,
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "LOG_LEVEL": "INFO",
        "PYTHONUNBUFFERED": "1",
    })
    return env


class WrappedProducer:
    """A real producer behind the engine's producer interface, for wrappers that change produce()."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._producer = Producer(config)

    def poll(self, timeout: float = 0) -> int:
        return self._producer.poll(timeout)

    def flush(self, timeout: float = 0) -> int:
        return self._producer.flush(timeout)

    def purge(self, *args: Any, **kwargs: Any) -> None:
        self._producer.purge(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._producer)


class FaultyProducer(WrappedProducer):
    """A real producer that sometimes refuses a record or reports a delivery as failed.

    A reported failure may follow a real delivery (the ack was "lost"), so the harvester resends
    and the topic gets a repeat: allowed, as long as no key ever goes backwards.
    """

    def __init__(self, config: dict[str, Any], *, fail_delivery: float, refuse: float, seed: int) -> None:
        super().__init__(config)
        self._random = random.Random(seed)
        self._fail_delivery, self._refuse = fail_delivery, refuse
        self.injected = 0

    def produce(self, topic: str, value: Any = None, key: Any = None, on_delivery: Any = None, **kwargs: Any) -> None:
        if on_delivery is not None and self._random.random() < self._refuse:
            self.injected += 1
            raise BufferError("injected: local queue full")
        if on_delivery is not None and self._random.random() < self._fail_delivery:
            self.injected += 1
            real = on_delivery

            def on_delivery(error: Any, message: Any) -> None:
                real(error or KafkaError(KafkaError._MSG_TIMED_OUT, "injected delivery failure"), message)

        self._producer.produce(topic, value=value, key=key, on_delivery=on_delivery, **kwargs)


class RecordingProducer(WrappedProducer):
    """A real producer that notes each acknowledged delivery: (the broker's append time, the replica's name,
    when the acknowledgement arrived, the outbox id).

    On a LogAppendTime topic the delivery report carries the time the broker appended the message,
    so deliveries of several replicas can be put in one order, as Kafka saw them.
    """

    def __init__(self, config: dict[str, Any], name: str, deliveries: list[tuple[float, str, float, int]]) -> None:
        super().__init__(config)
        self._name = name
        self._deliveries = deliveries

    def produce(self, topic: str, value: Any = None, key: Any = None, on_delivery: Any = None, **kwargs: Any) -> None:
        real = on_delivery
        record_id = int(dict(kwargs.get("headers") or []).get("outbox-id", -1))  # a delivery report has no headers

        def noted(error: Any, message: Any) -> None:
            if error is None:
                self._deliveries.append((message.timestamp()[1] / 1000, self._name, time.time(), record_id))
            if real is not None:
                real(error, message)

        self._producer.produce(topic, value=value, key=key, on_delivery=noted, **kwargs)


class FaultyStore:
    """A real store whose marks sometimes fail after reading and whose purges sometimes fail before.

    The second mark that returns rows and the second purge always fail, so every run meets both
    faults however the records happen to be batched; the rest fail at random."""

    def __init__(self, store: Any, *, fail_mark: float, fail_purge: float, seed: int) -> None:
        self._store = store
        self._random = random.Random(seed)
        self._fail_mark, self._fail_purge = fail_mark, fail_purge
        self._marks = self._purges = 0
        self.marks_failed = self.purges_failed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)  # the fence, held rows, parking, close: as they are

    def mark(self, limit: int, after: int, gaps: Sequence[tuple[int, int]] = ()) -> Any:
        marked = self._store.mark(limit, after, gaps)
        if marked[0]:
            self._marks += 1
            if self._marks == 2 or self._random.random() < self._fail_mark:
                self.marks_failed += 1
                raise psycopg.OperationalError("injected: connection lost after the mark ran")
        return marked

    def purge(self, ids: Sequence[int], read_fence: bool = True, durable: bool = True) -> tuple[int, bool]:
        self._purges += 1
        if self._purges == 2 or self._random.random() < self._fail_purge:
            self.purges_failed += 1
            raise psycopg.OperationalError("injected: purge failed")
        return self._store.purge(ids, read_fence, durable)
