"""Benchmarks of outbox.queue that print figures (never assert them).

    manage.py queue_bench send --messages 5000
    manage.py queue_bench throughput --messages 20000 --consumers 1 --consumers 4 [--handler-ms 10]
    manage.py queue_bench redelivery --runs 5 --redelivery-timeout 2
    manage.py queue_bench compare --peer kafka-mq-go --peer-bin /work/ext/kafka-mq-go-harness/harness

send: messages/s of send() one at a time (each waits for Kafka's ack) and of send_many() in
batches of 1,000 (kafka-mq-go's bench measures its Send and SendAsync the same two ways).

throughput and redelivery run the real `manage.py outbox_consume` and `outbox_redeliver` in subprocesses on a fresh
topic pair of the project's Kafka, and need a migrated database `default` (status rows).

throughput: consumers (one worker each; a handler that sleeps --handler-ms, 0 by default: a no-op, then notes
the time) start first; then messages of 256 bytes are sent with send_many() in batches of 1,000. Each --backend
(default both: markers, then share) runs with each --consumers count and each --handler-ms in the same run.
Markers: measured from the first send to the broker's append time of the last End marker (the last ack), read
back from the markers topic. Share (Kafka 4.2+): to the last handler's return (its ACCEPT goes to the broker right
after, on the consumer's next round), read from the handlers' event file; share groups have no log of acks. A
share run starts its clock after a warm-up message and two share heartbeats (every consumer joined). Each run
also prints the CPU seconds the Kafka broker (the process listening on the bootstrap port, when it runs on this
machine) used per 1,000 messages from the first send to the last message handled, and the load average.

redelivery: two consumers of a queue; the one started with BENCH_VICTIM=1 hangs on its first
message and is SIGKILLed. Measured from the kill to the other consumer running the redelivered
message (its handler's clock and ours are the same monotonic clock).

--peer kafka-mq-go --peer-bin PATH (throughput, redelivery, compare): also run splunk/kafka-mq-go through a
harness built outside this repository (docs/benchmarks.md says how), with the same messages, consumers, handler
time and redelivery timeout, and read the figures it prints (project/bench/queue_compare.py).

compare: all of it in one run, one table: each backend (and the peer) with 1 and 4 consumers, a no-op and a
10 ms handler (--slow-messages for the slow handler), SIGKILL to handled elsewhere (--runs each), and the
broker's CPU.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.test import override_settings

from outbox.queue import api, app_settings, markers
from outbox.queue.config import QueueLimits
from outbox.queue.topics import ensure_topics
from project.bench import queue_compare
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
        throughput.add_argument("--handler-ms", type=int, action="append", dest="handler_ms",
                                help="each message's handler sleeps this long (repeat for several runs; default 0)")
        throughput.add_argument("--payload-bytes", type=int, default=256)
        throughput.add_argument("--partitions", type=int, default=8, help="partitions of the queue topic")
        throughput.add_argument("--backend", action="append", choices=["markers", "share"], dest="backends",
                                help="queue backend (repeat for several; default markers and share)")
        throughput.add_argument("--redelivery-timeout", type=float,
                                help="the consumers' (and the peer's) redelivery timeout; default the queue's (30 s)")
        throughput.add_argument("--consumer-arg", action="append", default=[], dest="consumer_args",
                                help="extra flag for outbox_consume, e.g. --consumer-arg=--max-in-progress=100")
        redelivery = sub.add_parser("redelivery", help="seconds from a consumer's SIGKILL to the redelivered message "
                                                       "being processed by another consumer")
        redelivery.add_argument("--runs", type=int, default=5)
        redelivery.add_argument("--redelivery-timeout", type=float, default=2.0)
        redelivery.add_argument("--backend", action="append", choices=["markers", "share"], dest="backends",
                                help="share: the redelivery timeout is the share group's lock (1 s at least); "
                                     "repeat for several (default markers)")
        compare = sub.add_parser("compare", help="one table: each backend and the peer, 1 and 4 consumers, a no-op "
                                                 "and a 10 ms handler, SIGKILL to handled elsewhere, broker CPU")
        compare.add_argument("--messages", type=int, default=20_000, help="messages of a no-op handler's runs")
        compare.add_argument("--slow-messages", type=int, default=2_000,
                             help="messages of the runs whose handler sleeps (--handler-ms above 0)")
        compare.add_argument("--consumers", type=int, action="append", help="default 1 and 4")
        compare.add_argument("--handler-ms", type=int, action="append", dest="handler_ms", help="default 0 and 10")
        compare.add_argument("--payload-bytes", type=int, default=256)
        compare.add_argument("--partitions", type=int, default=8, help="partitions of the queue topic")
        compare.add_argument("--backend", action="append", choices=["markers", "share"], dest="backends",
                             help="default markers and share")
        compare.add_argument("--runs", type=int, default=3, help="SIGKILLs per backend (0: none)")
        compare.add_argument("--redelivery-timeout", type=float, default=2.0,
                             help="of the SIGKILL runs (the throughput runs keep the queue's default, 30 s)")
        compare.add_argument("--idle-seconds", type=float, default=10.0,
                             help="the broker's CPU is read this long before the runs and after, with none running")
        compare.add_argument("--consumer-arg", action="append", default=[], dest="consumer_args",
                             help="extra flag for outbox_consume")
        for sub_parser in (throughput, redelivery, compare):
            sub_parser.add_argument("--peer", choices=queue_compare.PEERS,
                                    help="also run this queue library, through --peer-bin")
            sub_parser.add_argument("--peer-bin", metavar="PATH",
                                    help="the peer's harness binary (built outside this repository: "
                                         "docs/benchmarks.md)")
            sub_parser.add_argument("--peer-arg", action="append", default=[], dest="peer_args",
                                    help="extra flag for the harness, e.g. --peer-arg=-session-timeout-ms=10000")

    def handle(self, *args: Any, mode: str, **options: Any) -> None:
        if mode != "send":
            self._check_peer(options["peer"], options["peer_bin"])
        for handler in options.get("handler_ms") or []:
            if handler < 0:
                raise CommandError(f"--handler-ms: must be 0 or more, got {handler}")
        if mode == "redelivery" and options["runs"] < 1:
            raise CommandError(f"--runs: must be 1 or more, got {options['runs']}")
        getattr(self, f"bench_{mode}")(**options)

    @staticmethod
    def _check_peer(peer: str | None, peer_bin: str | None) -> None:
        if peer and not peer_bin:
            raise CommandError(f"--peer-bin: required with --peer {peer} (the harness binary; docs/benchmarks.md, "
                               f"\"Queue backends side by side\", says how to build it)")
        if peer_bin and not peer:
            raise CommandError("--peer-bin: given without --peer")
        if peer_bin and not os.access(peer_bin, os.X_OK):
            raise CommandError(f"--peer-bin: {peer_bin} is not an executable file")

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

    def bench_throughput(self, messages: int, consumers: list[int] | None, handler_ms: list[int] | None,
                         payload_bytes: int, partitions: int, consumer_args: list[str], backends: list[str] | None,
                         redelivery_timeout: float | None, peer: str | None, peer_bin: str | None,
                         peer_args: list[str], **_: Any) -> None:
        for backend in [*(backends or ["markers", "share"]), *([peer] if peer else [])]:
            for handler in handler_ms or [0]:
                for count in consumers or [1, 4]:
                    self._throughput(backend, count, messages, handler, payload_bytes, partitions, consumer_args,
                                     redelivery_timeout, peer_bin, peer_args)

    def _throughput(self, backend: str, count: int, messages: int, handler_ms: int, payload_bytes: int,
                    partitions: int, consumer_args: list[str], redelivery_timeout: float | None,
                    peer_bin: str | None, peer_args: list[str]) -> queue_compare.Throughput:
        broker = queue_compare.Broker(_bootstrap())
        if backend == "kafka-mq-go":
            assert peer_bin is not None
            result = self._peer_throughput(peer_bin, peer_args, broker, count, messages, handler_ms,
                                           payload_bytes, partitions, redelivery_timeout)
        else:
            args = [*consumer_args, *(["--redelivery-timeout", f"{redelivery_timeout:g}"]
                                      if redelivery_timeout is not None else [])]
            run = self._share_run if backend == "share" else self._markers_run
            result = run(broker, count, messages, handler_ms, payload_bytes, partitions, args)
        per = result.per_1000()
        broker_used = "n/a" if per is None else f"{per.cpu:.2f} CPU s, {per.written / 1e6:.2f} MB written /1k msgs"
        self.stdout.write(
            f"backend={backend} consumers={count} handler={handler_ms}ms messages={messages} "
            f"payload={payload_bytes}B end-to-end={result.rate:,.0f} msg/s ({result.seconds:.2f} s) "
            f"broker={broker_used} load={result.load:.2f}", ending="\n")
        self.stdout.flush()
        return result

    def _send_all(self, messages: int, payload_bytes: int) -> tuple[float, float]:
        payload = "x" * payload_bytes
        started = time.time()
        for offset in range(0, messages, 1000):
            api.send_many(QUEUE, [payload] * min(1000, messages - offset))
        return started, time.time()

    def _markers_run(self, broker: queue_compare.Broker, count: int, messages: int, handler_ms: int,
                     payload_bytes: int, partitions: int, consumer_args: list[str]) -> queue_compare.Throughput:
        prefix = f"bench-{uuid.uuid4().hex[:8]}"
        with self._queues(prefix, partitions=partitions) as config, tempfile.TemporaryDirectory() as tmp:
            events = Path(tmp) / "handled"
            events.touch()
            env = {"BENCH_EVENTS": str(events), "BENCH_HANDLER_MS": str(handler_ms)}
            processes = [self._spawn(prefix, "outbox_redeliver", [], name="tracker")]
            processes += [self._spawn(prefix, "outbox_consume", ["--queue", QUEUE, "--handler",
                                                                "project.bench.queue_handlers.counted",
                                                                *consumer_args], name=f"consumer-{n}", env=env)
                          for n in range(count)]
            try:
                self._wait_for_group(config, count)
                usage = broker.usage()
                started, _sent = self._send_all(messages, payload_bytes)
                self._handled(events, messages)
                usage, stretch = queue_compare.used(usage, broker.usage()), time.time() - started
                last_ack = self._last_end(config, messages, timeout=600)
            finally:
                self._stop(processes)
        return queue_compare.Throughput("markers", count, handler_ms, messages, last_ack - started, usage, stretch,
                                        queue_compare.load_average())

    def _share_run(self, broker: queue_compare.Broker, count: int, messages: int, handler_ms: int,
                   payload_bytes: int, partitions: int, consumer_args: list[str]) -> queue_compare.Throughput:
        prefix = f"bench-{uuid.uuid4().hex[:8]}"
        with self._queues(prefix, partitions=partitions, backend="share"), tempfile.TemporaryDirectory() as tmp:
            events = Path(tmp) / "handled"
            events.touch()
            logs = [Path(tmp) / f"consumer-{n}.log" for n in range(count)]
            processes = [self._spawn(prefix, "outbox_consume", ["--queue", QUEUE, "--handler",
                                                               "project.bench.queue_handlers.counted",
                                                               *consumer_args], name=f"consumer-{n}",
                                     env={"BENCH_EVENTS": str(events), "BENCH_HANDLER_MS": str(handler_ms),
                                          "OUTBOX_QUEUE_BACKEND": "share", "LOG_LEVEL": "INFO"}, log=log)
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
                usage = broker.usage()
                started, _sent = self._send_all(messages, payload_bytes)
                lines = self._handled(events, messages)
                usage, stretch = queue_compare.used(usage, broker.usage()), time.time() - started
            finally:
                self._stop(processes)
        return queue_compare.Throughput("share", count, handler_ms, messages, max(lines) - started, usage, stretch,
                                        queue_compare.load_average())

    @staticmethod
    def _handled(events: Path, messages: int, timeout: float = 600) -> list[float]:
        """The handlers' return times (epoch seconds), once there are `messages` of them."""
        deadline = time.monotonic() + timeout
        while True:
            lines = events.read_text().split()
            if len(lines) >= messages:
                return list(map(float, lines))
            if time.monotonic() > deadline:
                raise CommandError(f"only {len(lines)} of {messages} messages handled within {timeout:.0f} s")
            time.sleep(0.1)

    # -- the peer ---------------------------------------------------------------------------------

    def _peer_throughput(self, binary: str, peer_args: list[str], broker: queue_compare.Broker, count: int,
                         messages: int, handler_ms: int, payload_bytes: int, partitions: int,
                         redelivery_timeout: float | None) -> queue_compare.Throughput:
        if redelivery_timeout is None:
            redelivery_timeout = QueueLimits.redelivery_timeout  # what our consumers get by default
        argv = queue_compare.harness_throughput_argv(
            binary, bootstrap=_bootstrap(), messages=messages, consumers=count,
            handler_ms=handler_ms, redelivery_timeout=redelivery_timeout, payload_bytes=payload_bytes,
            partitions=partitions, extra=peer_args)
        usage: queue_compare.Usage | None = None
        started = 0.0
        found = None
        for line in self._harness(argv):
            if line.kind == "stretch-start":
                usage, started = broker.usage(), time.time()
            elif line.kind == "throughput":
                usage, stretch = queue_compare.used(usage, broker.usage()), time.time() - started
                found = queue_compare.Throughput("kafka-mq-go", count, handler_ms, messages, line.number("seconds"),
                                                 usage, stretch, queue_compare.load_average())
                if line.number("duplicates"):
                    self.stdout.write(f"kafka-mq-go: {line.number('duplicates'):.0f} messages handled twice")
        if found is None:
            raise CommandError("the kafka-mq-go harness exited without a throughput line")
        return found

    def _peer_redelivery(self, binary: str, peer_args: list[str], runs: int,
                         redelivery_timeout: float) -> list[float]:
        argv = queue_compare.harness_redelivery_argv(
            binary, bootstrap=_bootstrap(), runs=runs,
            redelivery_timeout=redelivery_timeout, extra=peer_args)
        timings = []
        for line in self._harness(argv):
            if line.kind == "redelivery":
                timings.append(line.number("seconds"))
                self.stdout.write(f"run {len(timings)}: redelivered and processed {timings[-1]:.2f} s after the "
                                  f"SIGKILL (kafka-mq-go)")
        if len(timings) != runs:
            raise CommandError(f"the kafka-mq-go harness printed {len(timings)} of {runs} redelivery runs")
        return timings

    @staticmethod
    def _harness(argv: list[str]) -> Iterator[queue_compare.HarnessLine]:
        """Runs the harness, yielding its own lines as they come (its stderr goes to a file, shown on failure)."""
        with tempfile.TemporaryFile("w+") as errors, subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=errors, text=True, bufsize=1, start_new_session=True) as process:
            try:
                assert process.stdout is not None
                for raw in process.stdout:
                    try:
                        line = queue_compare.parse_harness_line(raw.rstrip("\n"))
                    except queue_compare.HarnessError as exc:
                        raise CommandError(str(exc)) from None
                    if line is not None:
                        yield line
                code = process.wait(timeout=120)
            finally:
                if process.poll() is None:
                    process.kill()
            if code != 0:
                errors.seek(0)
                tail = " | ".join(errors.read().strip().splitlines()[-5:])
                raise CommandError(f"the kafka-mq-go harness exited with status {code}: {tail or '-'}")

    def _wait_for_group(self, config: Any, members: int, timeout: float = 60) -> None:
        """Until the consumer group has `members` members with partitions (a warm-up message goes round)."""
        from confluent_kafka.admin import AdminClient

        from outbox.kafka.clients import admin_config

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

    def bench_redelivery(self, runs: int, redelivery_timeout: float, backends: list[str] | None, peer: str | None,
                         peer_bin: str | None, peer_args: list[str], **_: Any) -> None:
        for backend in [*(backends or ["markers"]), *([peer] if peer else [])]:
            self._kills(backend, runs, redelivery_timeout, peer_bin, peer_args)

    def _kills(self, backend: str, runs: int, redelivery_timeout: float, peer_bin: str | None,
               peer_args: list[str]) -> queue_compare.Kills:
        if backend == "kafka-mq-go":
            assert peer_bin is not None
            timings = self._peer_redelivery(peer_bin, peer_args, runs, redelivery_timeout)
        else:
            timings = self._our_kills(backend, runs, redelivery_timeout)
        self.stdout.write(f"backend={backend} redelivery_timeout={redelivery_timeout:g}s runs={runs} "
                          f"median={statistics.median(timings):.2f} s min={min(timings):.2f} s "
                          f"max={max(timings):.2f} s load={queue_compare.load_average():.2f}")
        return queue_compare.Kills(backend, timings, queue_compare.load_average())

    def _our_kills(self, backend: str, runs: int, redelivery_timeout: float) -> list[float]:
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
                    helpers.append(victim)  # stopped with the others if a run fails before its SIGKILL
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
        return timings

    # -- all of it, one table ---------------------------------------------------------------------

    def bench_compare(self, messages: int, slow_messages: int, consumers: list[int] | None,
                      handler_ms: list[int] | None, payload_bytes: int, partitions: int, backends: list[str] | None,
                      runs: int, redelivery_timeout: float, idle_seconds: float, consumer_args: list[str],
                      peer: str | None, peer_bin: str | None, peer_args: list[str], **_: Any) -> None:
        names = [*(backends or ["markers", "share"]), *([peer] if peer else [])]
        broker = queue_compare.Broker(_bootstrap())
        if broker.pid is None:
            self.stdout.write(f"no process listens on {_bootstrap()} here: the broker's CPU is not measured")
        idle = [self._idle(broker, idle_seconds)]
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        throughputs = [self._throughput(backend, count, slow_messages if handler else messages, handler,
                                        payload_bytes, partitions, consumer_args, None, peer_bin, peer_args)
                       for handler in handler_ms or [0, 10]
                       for count in consumers or [1, 4]
                       for backend in names]
        kills = [self._kills(backend, runs, redelivery_timeout, peer_bin, peer_args) for backend in names] \
            if runs else []
        idle.append(self._idle(broker, idle_seconds))
        known = [rate for rate in idle if rate is not None]
        mean = queue_compare.Usage(statistics.mean(u.cpu for u in known),
                                   round(statistics.mean(u.written for u in known))) if known else None
        rates = " / ".join("n/a" if u is None else f"{u.cpu:.3f} CPU s/s, {u.written / 1e3:,.0f} kB/s written"
                           for u in idle)
        self.stdout.write(f"\n{started} to {time.strftime('%H:%M:%S %Z')}; the broker idle before / after: {rates}\n")
        self.stdout.write(queue_compare.format_table(throughputs, kills, backends=names,
                                                     redelivery_timeout=redelivery_timeout, idle=mean))

    def _idle(self, broker: queue_compare.Broker, seconds: float) -> queue_compare.Usage | None:
        """What the broker used per second over `seconds` with none of ours running."""
        if seconds <= 0:
            return None
        before = broker.usage()
        time.sleep(seconds)
        spent = queue_compare.used(before, broker.usage())
        return None if spent is None else spent.per_second(seconds)

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


def _bootstrap() -> str:
    return str(settings.OUTBOX["base_kafka_config"]["bootstrap.servers"])
