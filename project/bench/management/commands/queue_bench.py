"""Benchmarks of outbox.queue that print figures (never assert them).

    manage.py queue_bench send --messages 5000
    manage.py queue_bench throughput --messages 20000 --consumers 1 --consumers 4
    manage.py queue_bench redelivery --runs 5 --redelivery-timeout 2

send: messages/s of send() one at a time (each waits for Kafka's ack) and of send_many() in
batches of 1,000 (kafka-mq-go's bench measures its Send and SendAsync the same two ways).

throughput and redelivery run the real `manage.py outbox_consume` and `outbox_redeliver` in subprocesses on a fresh
topic pair of the project's Kafka, and need a migrated database `default` (status rows).

throughput: consumers (one worker each, a no-op handler) start first; then messages of 256 bytes
are sent with send_many() in batches of 1,000. Each --backend (default both: markers, then share)
runs with each --consumers count in the same run. Markers: measured from the first send to the
broker's append time of the last End marker (the last ack), read back from the markers topic.
Share (Kafka 4.2+): to the last handler's return (its ACCEPT goes to the broker right after, on the
consumer's next round), read from the handlers' event file; share groups have no log of acks. A
share run starts its clock after a warm-up message and two share heartbeats (every consumer joined).

redelivery: two consumers of a queue; the one started with BENCH_VICTIM=1 hangs on its first
message and is SIGKILLed. Measured from the kill to the other consumer running the redelivered
message (its handler's clock and ours are the same monotonic clock).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.test import override_settings

from outbox.queue import api, app_settings, markers
from outbox.queue.topics import ensure_topics
from project.settings import queue_names

ROOT = Path(__file__).resolve().parents[4]
QUEUE = "bench"
#: Seconds a share run waits after its warm-up message: two share-group heartbeats (5 s by default).
SHARE_JOIN_SETTLE = 10.0


class Command(BaseCommand):
    help = "Measure outbox.queue: messages/s through send, receive, a no-op handler and ack; crash-to-redelivery time."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="mode", required=True)
        send = sub.add_parser("send", help="messages/s of send() and send_many()")
        send.add_argument("--messages", type=int, default=5000)
        send.add_argument("--payload-bytes", type=int, default=256)
        throughput = sub.add_parser("throughput", help="messages/s from the first send to the last ack")
        throughput.add_argument("--messages", type=int, default=20_000)
        throughput.add_argument("--consumers", type=int, action="append",
                                help="consumer processes (repeat for several runs; default 1 and 4)")
        throughput.add_argument("--payload-bytes", type=int, default=256)
        throughput.add_argument("--partitions", type=int, default=8, help="partitions of the queue topic")
        throughput.add_argument("--backend", action="append", choices=["markers", "share"], dest="backends",
                                help="queue backend (repeat for several; default markers and share)")
        throughput.add_argument("--consumer-arg", action="append", default=[], dest="consumer_args",
                                help="extra flag for outbox_consume, e.g. --consumer-arg=--max-in-progress=100")
        redelivery = sub.add_parser("redelivery", help="seconds from a consumer's SIGKILL to the redelivered message "
                                                       "being processed by another consumer")
        redelivery.add_argument("--runs", type=int, default=5)
        redelivery.add_argument("--redelivery-timeout", type=float, default=2.0)
        redelivery.add_argument("--backend", choices=["markers", "share"], default="markers",
                                help="share: the redelivery timeout is the share group's lock (1 s at least)")

    def handle(self, *args: Any, mode: str, **options: Any) -> None:
        getattr(self, f"bench_{mode}")(**options)

    # -- send -------------------------------------------------------------------------------------

    def bench_send(self, messages: int, payload_bytes: int, **_: Any) -> None:
        payload = "x" * payload_bytes
        with self._queues(f"bench-{uuid.uuid4().hex[:8]}", partitions=8):
            api.send(QUEUE, payload)  # the producer's connection and the topic metadata, outside the timing
            started = time.perf_counter()
            for _ in range(messages):
                api.send(QUEUE, payload)
            one = messages / (time.perf_counter() - started)
            started = time.perf_counter()
            for offset in range(0, messages, 1000):
                api.send_many(QUEUE, [payload] * min(1000, messages - offset))
            many = messages / (time.perf_counter() - started)
        self.stdout.write(f"messages={messages} payload={payload_bytes}B send()={one:,.0f} msg/s "
                          f"send_many()={many:,.0f} msg/s")

    # -- throughput -------------------------------------------------------------------------------

    def bench_throughput(self, messages: int, consumers: list[int] | None, payload_bytes: int, partitions: int,
                         consumer_args: list[str], backends: list[str] | None, **_: Any) -> None:
        for backend in backends or ["markers", "share"]:
            for count in consumers or [1, 4]:
                if backend == "share":
                    elapsed, sending = self._share_run(count, messages, payload_bytes, partitions, consumer_args)
                else:
                    elapsed, sending = self._markers_run(count, messages, payload_bytes, partitions, consumer_args)
                self.stdout.write(
                    f"backend={backend} consumers={count} messages={messages} payload={payload_bytes}B "
                    f"send={messages / sending:,.0f} msg/s end-to-end={messages / elapsed:,.0f} msg/s "
                    f"({elapsed:.2f} s)")

    def _send_all(self, messages: int, payload_bytes: int) -> tuple[float, float]:
        payload = "x" * payload_bytes
        started = time.time()
        for offset in range(0, messages, 1000):
            api.send_many(QUEUE, [payload] * min(1000, messages - offset))
        return started, time.time()

    def _markers_run(self, count: int, messages: int, payload_bytes: int, partitions: int,
                     consumer_args: list[str]) -> tuple[float, float]:
        prefix = f"bench-{uuid.uuid4().hex[:8]}"
        with self._queues(prefix, partitions=partitions) as config:
            processes = [self._spawn(prefix, "outbox_redeliver", [], name="tracker")]
            processes += [self._spawn(prefix, "outbox_consume", ["--queue", QUEUE, "--handler",
                                                                "project.bench.queue_handlers.noop",
                                                                *consumer_args], name=f"consumer-{n}")
                          for n in range(count)]
            try:
                self._wait_for_group(config, count)
                started, sent = self._send_all(messages, payload_bytes)
                last_ack = self._last_end(config, messages, timeout=600)
            finally:
                self._stop(processes)
        return last_ack - started, sent - started

    def _share_run(self, count: int, messages: int, payload_bytes: int, partitions: int,
                   consumer_args: list[str]) -> tuple[float, float]:
        prefix = f"bench-{uuid.uuid4().hex[:8]}"
        with self._queues(prefix, partitions=partitions, backend="share"), tempfile.TemporaryDirectory() as tmp:
            events = Path(tmp) / "handled"
            events.touch()
            logs = [Path(tmp) / f"consumer-{n}.log" for n in range(count)]
            processes = [self._spawn(prefix, "outbox_consume", ["--queue", QUEUE, "--handler",
                                                               "project.bench.queue_handlers.noop_counted",
                                                               *consumer_args], name=f"consumer-{n}",
                                     env={"BENCH_EVENTS": str(events), "OUTBOX_QUEUE_BACKEND": "share",
                                          "LOG_LEVEL": "INFO"}, log=log)
                         for n, log in enumerate(logs)]
            try:
                deadline = time.monotonic() + 60
                while not all("Consuming share queue" in log.read_text(errors="replace") for log in logs):
                    if time.monotonic() > deadline:
                        raise CommandError(f"the {count} share consumer(s) did not start within 60 s (see {tmp})")
                    time.sleep(0.2)
                # Warm-up, outside the timing: one message handled, then two share heartbeats (5 s each, the
                # broker's default) so every member has its assignment before the clock starts.
                api.send(QUEUE, "warm-up")
                deadline = time.monotonic() + 60
                while not events.read_text().strip():
                    if time.monotonic() > deadline:
                        tails = "; ".join(f"{log.name}: {_last_line(log)}" for log in logs)
                        raise CommandError(f"the warm-up message was not handled within 60 s ({tails})")
                    time.sleep(0.2)
                time.sleep(SHARE_JOIN_SETTLE)
                events.write_text("")  # the handlers append (O_APPEND): what they write next lands from 0
                started, sent = self._send_all(messages, payload_bytes)
                deadline = time.monotonic() + 600
                while True:
                    lines = events.read_text().split()
                    if len(lines) >= messages:
                        break
                    if time.monotonic() > deadline:
                        raise CommandError(f"only {len(lines)} of {messages} messages handled within 600 s")
                    time.sleep(0.2)
            finally:
                self._stop(processes)
        return max(map(float, lines)) - started, sent - started

    def _wait_for_group(self, config: Any, members: int, timeout: float = 60) -> None:
        """Until the consumer group has `members` members with partitions (a warm-up message goes round)."""
        from confluent_kafka.admin import AdminClient

        from outbox.harvest.kafka import admin_config

        admin = AdminClient(admin_config(config.base_kafka_config))
        group = config.consumer_group(QUEUE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            described = admin.describe_consumer_groups([group])[group].result(timeout=10)
            if len(described.members) == members and all(m.assignment.topic_partitions
                                                          for m in described.members):
                return
            time.sleep(0.5)
        raise CommandError(f"the {members} consumer(s) did not join group {group} within {timeout:.0f}s")

    def _last_end(self, config: Any, expected: int, timeout: float) -> float:
        """The broker's append time (epoch seconds) of the `expected`-th End marker of the bench queue."""
        consumer = Consumer({**config.base_kafka_config, "group.id": f"bench-{uuid.uuid4().hex}",
                             "enable.auto.commit": False, "isolation.level": "read_committed"})
        topic = config.markers_topic
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        ends, last = 0, 0.0
        deadline = time.monotonic() + timeout
        try:
            while ends < expected:
                if time.monotonic() > deadline:
                    raise CommandError(f"only {ends} of {expected} messages acked within {timeout:.0f}s")
                for record in consumer.consume(1000, timeout=0.5):
                    if record.error() is not None:
                        if record.error().code() != KafkaError._PARTITION_EOF:
                            raise CommandError(str(record.error()))
                        continue
                    if markers.header_text(record.headers(), markers.MARKER_HEADER) == "end":
                        ends += 1
                        last = max(last, record.timestamp()[1] / 1000)
        finally:
            consumer.close()
        return last

    # -- crash to redelivery ----------------------------------------------------------------------

    def bench_redelivery(self, runs: int, redelivery_timeout: float, backend: str, **_: Any) -> None:
        prefix = f"bench-{uuid.uuid4().hex[:8]}"
        timings: list[float] = []
        share = backend == "share"
        with self._queues(prefix, partitions=8, backend=backend) as config, tempfile.TemporaryDirectory() as tmp:
            events = Path(tmp) / "events"
            events.touch()
            args = ["--queue", QUEUE, "--handler", "project.bench.queue_handlers.hang_in_victim",
                    "--redelivery-timeout", str(redelivery_timeout)]
            env = {"BENCH_EVENTS": str(events), "OUTBOX_QUEUE_BACKEND": backend, "LOG_LEVEL": "INFO"}
            helpers = [] if share else [self._spawn(prefix, "outbox_redeliver", [], name="tracker", env=env)]
            helpers.append(self._spawn(prefix, "outbox_consume", args, name="survivor", env=env,
                                       log=Path(tmp) / "survivor.log"))
            try:
                for run in range(runs):
                    victim_log = Path(tmp) / f"victim-{run}.log"
                    victim = self._spawn(prefix, "outbox_consume", args, name=f"victim-{run}",
                                         env={**env, "BENCH_VICTIM": "1"}, log=victim_log)
                    if share:
                        self._wait_for_log([victim_log, Path(tmp) / "survivor.log"], "Consuming share queue")
                        time.sleep(SHARE_JOIN_SETTLE)
                    else:
                        self._wait_for_group(config, 2, timeout=120)
                    hung = None
                    while hung is None:  # send until a message lands on one of the victim's partitions (or it)
                        message_id = api.send(QUEUE, "work")
                        hung = self._event(events, message_id, timeout=30)
                        hung = hung if hung and hung[0] == "hang" else None
                    killed = time.monotonic()
                    victim.kill()
                    victim.wait()
                    done = self._event(events, message_id, timeout=120, want="done")
                    timings.append(done[1] - killed)
                    self.stdout.write(f"run {run + 1}: redelivered and processed {done[1] - killed:.2f} s after "
                                      f"the SIGKILL")
            finally:
                self._stop(helpers)
        self.stdout.write(f"backend={backend} redelivery_timeout={redelivery_timeout:g}s runs={runs} "
                          f"median={statistics.median(timings):.2f} s min={min(timings):.2f} s "
                          f"max={max(timings):.2f} s")

    @staticmethod
    def _wait_for_log(logs: list[Path], line: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not all(log.exists() and line in log.read_text(errors="replace") for log in logs):
            if time.monotonic() > deadline:
                raise CommandError(f"no {line!r} in {', '.join(map(str, logs))} within {timeout:.0f} s")
            time.sleep(0.2)

    @staticmethod
    def _event(path: Path, message_id: str, timeout: float, want: str | None = None) -> tuple[str, float] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in path.read_text().splitlines():
                parts = line.split()
                if len(parts) == 3 and parts[1] == message_id and (want is None or parts[0] == want):
                    return parts[0], float(parts[2])
            time.sleep(0.01)
        if want is None:
            return None
        raise CommandError(f"no {want} event for {message_id} within {timeout:.0f}s")

    # -- processes and topics ---------------------------------------------------------------------

    class _queues:
        """OUTBOX["queues"] on a fresh topic pair for this process (subprocesses get the prefix)."""

        def __init__(self, prefix: str, partitions: int, backend: str = "markers") -> None:
            self.override = override_settings(OUTBOX={**settings.OUTBOX, "queues": {
                **queue_names(prefix), "partitions": partitions, "markers_partitions": 4, "backend": backend}})

        def __enter__(self) -> Any:
            self.override.enable()
            config = app_settings.queue_config()
            ensure_topics(config, 10)
            return config

        def __exit__(self, *exc: object) -> None:
            self.override.disable()

    @staticmethod
    def _spawn(prefix: str, command: str, args: list[str], *, name: str,
               env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen[bytes]:
        full_env = {**os.environ, "OUTBOX_QUEUE_PREFIX": prefix, "LOG_LEVEL": "WARNING", **(env or {})}
        with open(log or os.devnull, "w") as out:
            return subprocess.Popen([sys.executable, str(ROOT / "manage.py"), command, "--name", name, *args],
                                    cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT if log else None)

    @staticmethod
    def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def _last_line(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines()
    return lines[-1] if lines else "-"
