"""The audit's benchmark: publish N harvested-format messages over K keys, audit them, print figures.

`manage.py outbox_audit_bench --messages 5000000 --keys 10000` (or `python -m project.bench.audit_bench`).
Prints producer messages/s, the audit's records/s (whole run, JVM start included, and the scan
alone) and the peak resident memory of this process and its children (the JVM), sampled with
psutil. Figures only, never asserted; results are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TextIO

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from outbox.pipeline import cli


class PeakMemory:
    """Samples the RSS of this process plus its descendants (the Spark JVM) in a thread."""

    def __init__(self, interval: float = 0.25) -> None:
        import psutil  # a test extra; only the benchmark needs it

        self._psutil = psutil
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)

    def _sample(self) -> int:
        me = self._psutil.Process()
        total = 0
        for process in [me, *me.children(recursive=True)]:
            try:
                total += process.memory_info().rss
            except self._psutil.Error:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def publish(bootstrap: str, topic: str, messages: int, keys: int, value_bytes: int, first_id: int = 1) -> float:
    """Produce `messages` like the harvester's (ids ascending from `first_id`, per-key order kept) over keys
    `key-0` to `key-<keys - 1>`; returns seconds."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50, "batch.size": 1_000_000,
                         "compression.type": "lz4", "queue.buffering.max.messages": 1_000_000,
                         "queue.buffering.max.kbytes": 1_048_576, "enable.idempotence": True})
    value = "v" * value_bytes
    key_names = [f"key-{n}" for n in range(keys)]
    began = time.perf_counter()
    created = b""
    for n in range(messages):
        if n % 1000 == 0:  # the create time moves on every 1,000 messages, as rows of one mark query
            stamp = datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
            created = stamp.encode()
        headers = [("outbox-id", str(n + first_id).encode()), ("outbox-create-time", created)]
        while True:
            try:
                producer.produce(topic, value=value, key=key_names[n % keys], headers=headers)
                break
            except BufferError:
                producer.poll(0.05)
        if n % 10_000 == 0:
            producer.poll(0)
    remaining = producer.flush(120)
    if remaining:
        raise RuntimeError(f"{remaining} messages not delivered")
    return time.perf_counter() - began


def run(messages: int, keys: int, partitions: int, bootstrap: str, master: str, value_bytes: int,
        confs: Sequence[str], keep_topic: bool, jars: str | None, stdout: TextIO, topic: str | None = None,
        sink_format: str | None = None) -> int:
    """Publish to a new topic (or, with `topic`, audit that existing one as it is), audit, print figures.

    With `sink_format`, the audit also writes `--sink` in that format, and the sink's step is timed.
    """
    admin = AdminClient({"bootstrap.servers": bootstrap})
    reuse = topic is not None
    if topic is None:
        topic = f"outbox-audit-bench-{uuid.uuid4().hex[:8]}"
        admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])[topic].result(30)
    try:
        if reuse:
            messages = _count(bootstrap, topic)
            stdout.write(f"audit benchmark: existing topic {topic}, {messages:,} messages\n")
        else:
            stdout.write(f"audit benchmark: {messages:,} messages over {keys:,} keys, {partitions} partitions, "
                         f"{value_bytes}-byte values, topic {topic}\n")
            stdout.flush()
            seconds = publish(bootstrap, topic, messages, keys, value_bytes)
            stdout.write(f"  produced        {messages / seconds:>12,.0f} messages/s  ({seconds:.1f} s)\n")
        stdout.flush()
        argv = ["--topics", topic, "--bootstrap-servers", bootstrap, "--master", master]
        for conf in confs:
            argv += ["--conf", conf]
        if jars:
            argv += ["--jars", jars]
        with tempfile.TemporaryDirectory(prefix="outbox-audit-bench-") as out, PeakMemory() as memory:
            if sink_format:
                argv += ["--sink", f"{out}/sink", "--format", sink_format]
            summary = io.StringIO()
            began = time.perf_counter()
            progress = _Timestamps(sys.stderr)
            code = cli.main([*argv, "--out", f"{out}/report"], stdout=summary, stderr=progress)
            seconds = time.perf_counter() - began
        scan = progress.scan_seconds()
        stdout.write("".join(line for line in summary.getvalue().splitlines(keepends=True)
                             if not line.startswith("report:")))  # the report went with the temporary folder
        stdout.write(f"  audit ({master}) {messages / seconds:>12,.0f} records/s  ({seconds:.1f} s, JVM start "
                     f"included)\n")
        if scan:
            stdout.write(f"  audit scan only {messages / scan:>12,.0f} records/s  ({scan:.1f} s, from the first "
                         f"Spark job to the report)\n")
        sink = progress.sink_seconds()
        if sink_format and sink:
            stdout.write(f"  sink ({sink_format}) {messages / sink:>12,.0f} records/s  ({sink:.1f} s, the sink's "
                         f"step alone)\n")
        stdout.write(f"  peak RSS        {memory.peak / 2**20:>12,.0f} MiB  (Python + JVM, sampled every "
                     f"{memory.interval:g} s)\n")
        return code
    finally:
        if not keep_topic and not reuse:
            admin.delete_topics([topic])[topic].result(30)


def _count(bootstrap: str, topic: str) -> int:
    """Messages in `topic` now (high minus low watermark, summed over its partitions)."""
    from outbox.pipeline import sources

    kafka = sources.Kafka(bootstrap, {})
    marks = sources.watermarks(kafka, sources.partitions(kafka, [topic]))
    return sum(high - low for parts in marks.values() for low, high in parts.values())


class _Timestamps(io.TextIOBase):
    """Passes the audit's progress lines through and notes when the scan starts and ends."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.marks: dict[str, float] = {}

    def write(self, text: str) -> int:
        if "reading the messages" in text:
            self.marks["scan"] = time.perf_counter()
        elif "writing the de-duplicated records" in text:
            self.marks["sink"] = time.perf_counter()
        elif "] done" in text:
            self.marks["done"] = time.perf_counter()
        self.stream.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def sink_seconds(self) -> float | None:
        if "sink" in self.marks and "done" in self.marks:
            return self.marks["done"] - self.marks["sink"]
        return None

    def scan_seconds(self) -> float | None:
        if "scan" in self.marks and "done" in self.marks:
            return self.marks["done"] - self.marks["scan"]
        return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--messages", type=int, default=5_000_000)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--value-bytes", type=int, default=100)
    parser.add_argument("--bootstrap-servers", default=None)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--jars", default=None)
    parser.add_argument("--keep-topic", action="store_true", help="leave the benchmark topic in Kafka")
    parser.add_argument("--topic", help="audit this existing topic (e.g. one left by --keep-topic) instead of "
                                        "publishing a new one")
    parser.add_argument("--sink-format", choices=("parquet", "delta"),
                        help="also write the de-duplicated records (--sink) in this format, and time that step")


def main(argv: Sequence[str] | None = None) -> int:
    import os

    parser = argparse.ArgumentParser(prog="python -m project.bench.audit_bench", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    bootstrap = args.bootstrap_servers or os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or "localhost:9092"
    return run(args.messages, args.keys, args.partitions, bootstrap, args.master, args.value_bytes, args.conf,
               args.keep_topic, args.jars, sys.stdout, topic=args.topic, sink_format=args.sink_format)


if __name__ == "__main__":
    sys.exit(main())
