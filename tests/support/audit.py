"""What the Spark tests share: messages as the harvester sends them, an audit run in-process or as a follow job of
its own, the plain-Python reference of the latest state, frames built by hand, and readers of the Delta tables."""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import signal
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from confluent_kafka import Producer

from outbox.pipeline import audit as pipeline_audit
from outbox.pipeline import cli

ROOT = Path(__file__).resolve().parent.parent.parent


def harvested(partition: int, key: str, outbox_id: int | None, *, created: str | None = "now",
              value: str | None = "v") -> dict:
    """A message as the harvester sends it; `outbox_id=None` / `created=None` leave a header out."""
    headers = [("source", "test")]
    if outbox_id is not None:
        headers.append(("outbox-id", str(outbox_id)))
    if created == "now":
        created = (datetime.now(UTC) - timedelta(milliseconds=50)).isoformat(timespec="microseconds")
        created = created.replace("+00:00", "Z")
    if created is not None:
        headers.append(("outbox-create-time", created))
    return {"partition": partition, "key": key, "value": value, "headers": headers}


def produce(bootstrap: str, topic: str, messages: list[dict]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": True})
    for message in messages:
        producer.produce(topic, key=message["key"], value=message["value"], headers=message["headers"],
                         partition=message["partition"])
    assert producer.flush(30) == 0


def in_order(partition: int, key: str, *ids: int) -> list[dict]:
    return [harvested(partition, key, outbox_id) for outbox_id in ids]


def audit(spark, bootstrap: str, out: Path, *args: str) -> tuple[int, dict, str, str]:
    """Run the audit in-process; returns (exit status, report, stdout, stderr)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    code = cli.main(["--bootstrap-servers", bootstrap, "--out", str(out), *args], stdout=stdout, stderr=stderr)
    report_file = out / "report.json"
    report = json.loads(report_file.read_text()) if report_file.exists() else {}
    return code, report, stdout.getvalue(), stderr.getvalue()


def follow_command(bootstrap: str, out: Path, topic: str, *args: str) -> list[str]:
    """`python -m outbox.pipeline --follow` as users start it, with a Spark JVM of its own (two local cores, no UI):
    for the tests that kill the job or outlast a broker under it, which the shared session cannot do."""
    return [sys.executable, "-m", "outbox.pipeline", "--bootstrap-servers", bootstrap, "--out", str(out),
            "--topics", topic, "--follow", "--trigger-interval", "1 second", "--master", "local[2]",
            "--conf", "spark.ui.enabled=false", "--conf", "spark.ui.showConsoleProgress=false", *args]


#: The environment of a follow job: Spark binds to the loopback address (tests talk only to 127.0.0.0/8).
FOLLOW_ENV = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"}


def start_follow(command: list[str], **popen) -> subprocess.Popen:
    """The job in a session of its own, so `kill_follow` ends Python and its JVM together."""
    return subprocess.Popen(command, cwd=ROOT, env=FOLLOW_ENV, start_new_session=True, **popen)


def kill_follow(job: subprocess.Popen) -> None:
    """SIGKILL the job's whole session (Python and the JVM it started, at once), if it still runs."""
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)


def newest_by_reference(messages: list[dict], *, tombstones: str = "delete") -> dict[str, tuple[str, int | None]]:
    """The latest-state table computed in plain Python, walking each key's messages in offset order.

    A message becomes its key's newest when it has no outbox id, or an id higher than any the key
    had; per key the partition where it reached its highest id wins; tombstones drop the key
    (`tombstones="mark"`: keep it, value None).
    """
    walked: dict[tuple[int, str], tuple[dict, int | None]] = {}
    for message in sorted(messages, key=lambda m: (m["partition"], m["offset"])):
        place = (message["partition"], message["key"])
        newest, highest = walked.get(place, (None, None))
        outbox_id = message["outbox_id"]
        if outbox_id is None or highest is None or outbox_id > highest:
            newest = message
            highest = outbox_id if outbox_id is not None else highest
        walked[place] = (newest, highest)
    chosen: dict[str, tuple[tuple, dict]] = {}
    for (partition, key), (newest, highest) in walked.items():
        rank = (highest is not None, highest or 0, partition)
        if key not in chosen or rank > chosen[key][0]:
            chosen[key] = (rank, newest)
    return {key: (newest["value"], newest["outbox_id"]) for key, (_, newest) in chosen.items()
            if newest["value"] is not None or tombstones == "mark"}


class Ledgered:
    """Messages produced to one topic, remembered with their offsets for the reference."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap, self.topic = bootstrap, topic
        self.sent: list[dict] = []

    def send(self, *messages: tuple[int, str, int | None, str | None]) -> None:
        batch = []
        for partition, key, outbox_id, value in messages:
            offset = sum(1 for m in self.sent if m["partition"] == partition)
            self.sent.append({"partition": partition, "offset": offset, "key": key, "outbox_id": outbox_id,
                              "value": value})
            batch.append(harvested(partition, key, outbox_id, value=value))
        produce(self.bootstrap, self.topic, batch)


RAW_SCHEMA = ("key binary, value binary, topic string, partition int, offset long, timestamp timestamp, "
              "timestampType int, headers array<struct<key:string,value:binary>>")

SENT = dt.datetime(2026, 1, 1, 0, 0, 1, tzinfo=dt.UTC)

CREATED = "2026-01-01T00:00:00.900000Z"  # 100 ms before SENT


def message(offset, key, outbox_id, *, topic="t", partition=0, created=CREATED, sent=SENT, value="v",
            headers=None):
    """A Kafka source row as the harvester's message would arrive; None leaves a header out."""
    found = [(name, text.encode()) for name, text in (headers or [])]
    if outbox_id is not None:
        found.append(("outbox-id", str(outbox_id).encode()))
    if created is not None:
        found.append(("outbox-create-time", created.encode()))
    return (key.encode(), None if value is None else value.encode(), topic, partition, offset, sent, 0, found)


def frame(spark, rows):
    return pipeline_audit.normalize(spark.createDataFrame(rows, RAW_SCHEMA))


#: (partition, key, outbox id, value): repeats, a reversal, tombstones, no ids, a key in two partitions.
FIRST = (
    (0, "a", 1, "a1"), (0, "a", 2, "a2"), (0, "a", 2, "a2"),
    (0, "b", 3, "b3"), (0, "b", 4, None),
    (1, "c", 5, "c5"), (1, "c", 7, "c7"), (1, "c", 6, "c6"),
    (1, "d", None, "d-plain"), (1, "d", 8, "d8"),
    (2, "e", 9, "e9"), (2, "e", None, "e-plain"),
    (3, "f", 10, "f10"), (2, "f", 12, "f12"),
)

SECOND = (
    (0, "a", 1, "a1"), (0, "b", 3, "b3"),           # late repeats: never newest, never bring b back
    (1, "c", 11, "c11"), (1, "d", None, "d-plain-2"), (2, "e", 13, "e13"),
    (3, "g", 14, "g14"), (3, "g", 15, None),        # created and deleted in one micro-batch
    (0, "h", 16, None),                             # a tombstone for a key never seen
    (0, "b", 17, "b17"),                            # a new record after the tombstone
    (3, "f", 18, "f18"),                            # f moves back to partition 3
    (2, "f", 12, "f12"),                            # a repeat in the old one
)


def spark_latest(spark, path: Path) -> dict[str, tuple[str | None, int | None]]:
    rows = spark.read.format("delta").load(str(path)).collect()
    assert len(rows) == len({row["key"] for row in rows}), "one row per key"
    return {row["key"]: (row["value"], row["outbox_id"]) for row in rows}


def first_ids(sent: list[dict]) -> dict[int, tuple[str, str | None]]:
    """Every outbox id once, with the key and value it was published with (a repeat carries the same)."""
    found: dict[int, tuple[str, str | None]] = {}
    for message in sent:
        if message["outbox_id"] is not None:
            found.setdefault(message["outbox_id"], (message["key"], message["value"]))
    return found


def spark_sink(spark, path: Path) -> dict[int, tuple[str, str | None]]:
    rows = spark.read.format("delta").load(str(path)).collect()
    assert len(rows) == len({row["outbox_id"] for row in rows}), "each id once"
    return {row["outbox_id"]: (row["key"], row["value"]) for row in rows}


def history(spark, path: Path) -> list[tuple[str, str]]:
    """(operation, userMetadata) of every commit, oldest first."""
    rows = spark.sql(f"DESCRIBE HISTORY delta.`{path}`").orderBy("version").collect()
    return [(row["operation"], row["userMetadata"]) for row in rows]


def micro_batches(*ids: int) -> list[str]:
    return [f"outbox-audit micro-batch {batch}" for batch in ids]
