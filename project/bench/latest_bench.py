"""The follow mode's `--latest` benchmark: micro-batches of new messages on top of a big table.

`manage.py outbox_latest_bench --rows 1000000 --messages 10000 --keys 10000` (or
`python -m project.bench.latest_bench`) publishes `rows` harvested-format messages, each of its own
key, to a new topic and folds them in follow mode (`--once`) into a `--latest` table of each
format, so that each table holds `rows` rows. Then it publishes `rounds` x `messages` more over
`keys` of those keys and folds them, per format, in one more run (`--max-offsets-per-trigger
messages`): `rounds` micro-batches of `messages` each in one JVM, as a long-running follow job
has them. For each it prints the whole micro-batch (the audit's checks, its state, the table) and
the table's own step (Parquet: today's rewrite of the whole table; Delta: the MERGE of the keys the
micro-batch changed). Figures only, never asserted; results are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import io
import re
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import TextIO

from confluent_kafka.admin import AdminClient, NewTopic

from outbox.pipeline import cli
from project.bench.audit_bench import publish

FORMATS = ("parquet", "delta")
_FOLDED = re.compile(r"batch (\d+): folded in ([\d.]+)s")
_TABLE = re.compile(r"batch (\d+): --latest (?:merged|rewritten) in ([\d.]+)s")


class _Lines(io.TextIOBase):
    """Passes the audit's progress lines through and keeps them."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.text: list[str] = []

    def write(self, text: str) -> int:
        self.text.append(text)
        self.stream.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def _follow(argv: list[str], table_format: str, work: str) -> tuple[int, dict[int, float], dict[int, float], float]:
    """One `--follow --once` run: (exit status, seconds per folded batch, seconds of its table step, wall time)."""
    lines = _Lines(sys.stderr)
    began = time.perf_counter()
    code = cli.main([*argv, "--out", f"{work}/{table_format}/out", "--latest", f"{work}/{table_format}/latest",
                     "--format", table_format, "--follow", "--once"], stdout=io.StringIO(), stderr=lines)
    text = "".join(lines.text)
    folded = {int(batch): float(seconds) for batch, seconds in _FOLDED.findall(text)}
    table = {int(batch): float(seconds) for batch, seconds in _TABLE.findall(text)}
    return code, folded, table, time.perf_counter() - began


def run(rows: int, messages: int, keys: int, partitions: int, bootstrap: str, master: str, rounds: int,
        confs: Sequence[str], jars: str | None, stdout: TextIO, formats: Sequence[str] = FORMATS) -> int:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    topic = f"outbox-latest-bench-{uuid.uuid4().hex[:8]}"
    admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])[topic].result(30)
    argv = ["--topics", topic, "--bootstrap-servers", bootstrap, "--master", master]
    for conf in confs:
        argv += ["--conf", conf]
    if jars:
        argv += ["--jars", jars]
    worst = 0
    try:
        stdout.write(f"latest benchmark: {rows:,} rows, then {rounds} micro-batches of {messages:,} messages over "
                     f"{keys:,} keys; {partitions} partitions, topic {topic}, {master}\n")
        seconds = publish(bootstrap, topic, rows, rows, 100)
        stdout.write(f"  produced {rows:,} messages in {seconds:.1f} s\n")
        stdout.flush()
        with tempfile.TemporaryDirectory(prefix="outbox-latest-bench-") as work:
            for table_format in formats:
                code, folded, table, wall = _follow(argv, table_format, work)
                worst = max(worst, code)
                stdout.write(f"  {table_format:8} first micro-batch ({rows:,} rows): folded in "
                             f"{folded.get(0, 0):.1f} s, table {table.get(0, 0):.1f} s "
                             f"(run {wall:.1f} s, exit {code})\n")
                stdout.flush()
            publish(bootstrap, topic, rounds * messages, keys, 100, first_id=rows + 1)
            for table_format in formats:
                code, folded, table, wall = _follow([*argv, "--max-offsets-per-trigger", str(messages)],
                                                    table_format, work)
                worst = max(worst, code)
                step = "MERGE" if table_format == "delta" else "rewrite"
                for batch in sorted(folded):
                    stdout.write(f"  {table_format:8} micro-batch {batch} ({messages:,} messages): "
                                 f"{folded[batch]:.1f} s in all, {step} of the table {table.get(batch, 0):.1f} s\n")
                stdout.write(f"  {table_format:8} (that run: {wall:.1f} s with the JVM's start, exit {code})\n")
                stdout.flush()
    finally:
        admin.delete_topics([topic])[topic].result(30)
    return worst


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows in --latest before the timed micro-batches")
    parser.add_argument("--messages", type=int, default=10_000, help="messages in each timed micro-batch")
    parser.add_argument("--keys", type=int, default=10_000, help="keys those messages are spread over")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--format", dest="formats", action="append", choices=FORMATS,
                        help="only this format (repeatable; default: both)")
    parser.add_argument("--bootstrap-servers", default=None)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--jars", default=None)


def main(argv: Sequence[str] | None = None) -> int:
    import os

    parser = argparse.ArgumentParser(prog="python -m project.bench.latest_bench", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    bootstrap = args.bootstrap_servers or os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or "localhost:9092"
    return run(args.rows, args.messages, args.keys, args.partitions, bootstrap, args.master, args.rounds, args.conf,
               args.jars, sys.stdout, formats=args.formats or FORMATS)


if __name__ == "__main__":
    sys.exit(main())
