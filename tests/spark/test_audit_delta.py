"""`outbox_audit --format delta`: the sink and the latest table as Delta Lake tables.

Checked against plain-Python references of what was produced: in batch mode, in follow mode
(one MERGE per micro-batch, one commit per micro-batch in the history), across a replayed
micro-batch, and across a SIGKILL of the whole follow job in the middle of a micro-batch. The
tables are read both with Spark (`format("delta")`) and without a JVM (the `deltalake` package).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable as RustDeltaTable
from deltalake import QueryBuilder

from tests.support.audit import (
    FIRST,
    FOLLOW_ENV,
    ROOT,
    SECOND,
    Ledgered,
    audit,
    first_ids,
    follow_command,
    history,
    kill_follow,
    micro_batches,
    newest_by_reference,
    spark_latest,
    spark_sink,
    start_follow,
)
from tests.support.doc_examples import python_block
from tests.support.spark_session import shared_session

pytestmark = [pytest.mark.integration, pytest.mark.spark]


@pytest.fixture(scope="module")
def spark():
    return shared_session()


def delta(*args: str) -> list[str]:
    return [*args, "--format", "delta"]


def rust_rows(path: Path, columns: str) -> list[dict]:
    """The table as the `deltalake` package reads it (no JVM): through its SQL engine, which applies the
    deletion vectors a MERGE leaves (its to_pyarrow_table() refuses tables that have them)."""
    found = QueryBuilder().register("t", RustDeltaTable(str(path))).execute(f"SELECT {columns} FROM t").read_all()
    return pa.table(found).to_pylist()


def rust_latest(path: Path) -> dict[str, tuple[str | None, int | None]]:
    return {row["key"]: (row["value"], row["outbox_id"]) for row in rust_rows(path, "key, value, outbox_id")}


def test_batch_tables_open_in_spark_and_without_a_jvm(spark, bootstrap_servers, new_topic, tmp_path):
    topic = new_topic("audit-delta-batch")
    messages = Ledgered(bootstrap_servers, topic)
    messages.send(*FIRST)
    sink, latest = tmp_path / "sink", tmp_path / "latest"
    code, report, _, stderr = audit(spark, bootstrap_servers, tmp_path / "out", "--topics", topic,
                                    *delta("--sink", str(sink), "--latest", str(latest)))
    assert (code, report["reversals"], report["run"]["format"]) == (1, 1, "delta"), stderr

    expected = newest_by_reference(messages.sent)
    assert set(expected) == {"a", "c", "d", "e", "f"}
    assert spark_latest(spark, latest) == rust_latest(latest) == expected
    assert spark_sink(spark, sink) == first_ids(messages.sent)
    plain = RustDeltaTable(str(sink)).to_pyarrow_table()  # the sink has no deletion vectors: any reader will do
    assert sorted(plain.column("outbox_id").to_pylist()) == sorted(first_ids(messages.sent))
    assert set(plain.column_names) >= {"topic", "partition", "offset", "timestamp", "key", "value", "headers",
                                       "outbox_id", "create_time"}
    assert history(spark, sink) == history(spark, latest) == [("WRITE", "outbox-audit batch run")]

    # docs/lakehouse.md's way to read both tables without a JVM, run as the page shows it (its tables in the
    # current directory, its topic this test's).
    reading = tmp_path / "reading"
    reading.mkdir()
    (reading / "dedup").symlink_to(sink)
    (reading / "latest").symlink_to(latest)
    example = python_block(ROOT / "docs" / "lakehouse.md", "from deltalake import").replace("'orders'", repr(topic))
    namespace: dict[str, object] = {}
    with contextlib.chdir(reading):
        exec(compile(example, "docs/lakehouse.md", "exec"), namespace)
    assert sorted(namespace["sink"].column("outbox_id").to_pylist()) == sorted(first_ids(messages.sent))
    rows = namespace["latest"].to_pylist()
    assert {row["key"]: (row["value"], row["outbox_id"]) for row in rows} == expected


@pytest.mark.slow
def test_follow_merges_each_micro_batch_once_as_the_reference_says(spark, bootstrap_servers, new_topic, tmp_path):
    """Slow: seven follow runs on Delta tables (a replay and refusals among them), OPTIMIZE and REORG."""
    topic = new_topic("audit-delta-follow")
    messages = Ledgered(bootstrap_servers, topic)
    messages.send(*FIRST)
    sink, latest = tmp_path / "sink", tmp_path / "latest"
    follow = ["--topics", topic, "--follow", "--once", "--max-offsets-per-trigger", "8"]
    tables = delta("--sink", str(sink), "--latest", str(latest))
    code, first, _, stderr = audit(spark, bootstrap_servers, tmp_path / "out", *follow, *tables)
    assert (code, first["run"]["batches_folded"]) == (1, [0, 1]), stderr
    assert spark_latest(spark, latest) == newest_by_reference(messages.sent)
    assert spark_sink(spark, sink) == first_ids(messages.sent)

    messages.send(*SECOND)
    follow[-1] = str(len(SECOND))  # one micro-batch
    code, second, _, stderr = audit(spark, bootstrap_servers, tmp_path / "out", *follow, *tables)
    assert (code, second["run"]["batches_folded"]) == (1, [2]), stderr
    expected = newest_by_reference(messages.sent)
    assert expected == {"a": ("a2", 2), "b": ("b17", 17), "c": ("c11", 11), "d": ("d-plain-2", None),
                        "e": ("e13", 13), "f": ("f18", 18)}
    assert spark_latest(spark, latest) == rust_latest(latest) == expected
    assert spark_sink(spark, sink) == first_ids(messages.sent)
    assert (second["messages"], second["distinct_ids"]) == (len(messages.sent), len(first_ids(messages.sent)))
    assert history(spark, latest) == list(zip(["WRITE", "MERGE", "MERGE"], micro_batches(0, 1, 2), strict=True))
    assert history(spark, sink) == [("WRITE", label) for label in micro_batches(0, 1, 2)]

    # A crash after the tables' commits and before the state counted micro-batch 2: Spark runs it again,
    # the audit folds it again, and Delta finds both commits of micro-batch 2 already in the log.
    checkpoint = tmp_path / "out" / "checkpoint"
    (checkpoint / "state" / f"batch-{2:012d}" / "_FOLDED").unlink()
    for name in ("2", ".2.crc"):
        (checkpoint / "spark" / "commits" / name).unlink(missing_ok=True)
    code, replayed, _, stderr = audit(spark, bootstrap_servers, tmp_path / "out", *follow, *tables)
    assert (code, replayed["run"]["batches_folded"]) == (1, [2]), stderr
    assert len(history(spark, latest)) == len(history(spark, sink)) == 3
    assert spark_latest(spark, latest) == expected
    assert spark_sink(spark, sink) == first_ids(messages.sent)
    assert {k: replayed[k] for k in ("messages", "distinct_ids", "duplicates", "reversals")} == {
        k: second[k] for k in ("messages", "distinct_ids", "duplicates", "reversals")}

    # The maintenance docs/audit.md recommends between runs leaves the same tables.
    spark.sql(f"OPTIMIZE delta.`{latest}`").collect()
    spark.sql(f"REORG TABLE delta.`{latest}` APPLY (PURGE)").collect()
    spark.sql(f"OPTIMIZE delta.`{sink}`").collect()
    assert spark_latest(spark, latest) == rust_latest(latest) == expected
    assert spark_sink(spark, sink) == first_ids(messages.sent)
    operations = [operation for operation, _ in history(spark, latest)]
    assert operations[3] == "OPTIMIZE" and set(operations[4:]) <= {"REORG"}  # REORG: only what OPTIMIZE left

    # The checkpoint's tables stay where they are and as they are.
    for changed, says in ((delta("--latest", str(tmp_path / "elsewhere")), "keeps its Delta table in"),
                          (["--latest", str(latest)], "keeps --latest as --format delta, not parquet"),
                          (delta("--latest", str(latest), "--tombstones", "mark"), "with --tombstones delete")):
        code, _, _, stderr = audit(spark, bootstrap_servers, tmp_path / "out", *follow, *changed)
        lines = stderr.strip().splitlines()
        assert code == 2 and says in lines[-1] and lines[-1].startswith("python -m outbox.pipeline: error: "), stderr
    # ... and the Delta --latest it kept must still be there (checked at start, not in a micro-batch's MERGE).
    moved = latest.rename(tmp_path / "moved")
    code, _, _, stderr = audit(spark, bootstrap_servers, tmp_path / "out", *follow, *tables)
    moved.rename(latest)
    assert code == 2 and "keeps a Delta table there, and there is none" in stderr.strip().splitlines()[-1], stderr


def _produce_keys(messages: Ledgered, start: int, count: int, keys: int = 12) -> None:
    """`count` messages from id `start` on over `keys` keys in 4 partitions, every 7th a tombstone, every 5th
    id published twice (a repeat after a failure)."""
    batch = []
    for n in range(start, start + count):
        key = f"k{n % keys}"
        message = (n % 4, key, n, None if n % 7 == 0 else f"{key}@{n}")
        batch.append(message)
        if n % 5 == 0:
            batch.append(message)
    messages.send(*batch)


def _folded(checkpoint: Path) -> set[int]:
    state = checkpoint / "state"
    return {int(path.parent.name.removeprefix("batch-")) for path in state.glob("batch-*/_FOLDED")}


def _committed(table: Path) -> set[int]:
    """Micro-batches with a commit in the Delta table's log (read as files: no Spark needed)."""
    found = set()
    for entry in (table / "_delta_log").glob("*.json"):
        for line in entry.read_text().splitlines():
            info = json.loads(line).get("commitInfo")
            if info and str(info.get("userMetadata", "")).startswith("outbox-audit micro-batch "):
                found.add(int(info["userMetadata"].rsplit(" ", 1)[1]))
    return found


@pytest.mark.slow
def test_a_sigkill_mid_batch_then_a_restart_leaves_exact_tables(spark, bootstrap_servers, new_topic, tmp_path):
    """The whole follow job (Python and its JVM) killed right after a micro-batch's sink commit, before its
    MERGE and before its state counted; restarted on the same checkpoint, it ends with the reference's tables.
    Slow: two follow jobs, each a Python process with a Spark JVM of its own, micro-batch by micro-batch."""
    topic = new_topic("audit-delta-kill")
    messages = Ledgered(bootstrap_servers, topic)
    _produce_keys(messages, 1, 30)
    sink, latest, out = tmp_path / "sink", tmp_path / "latest", tmp_path / "out"
    command = follow_command(bootstrap_servers, out, topic, *delta("--sink", str(sink), "--latest", str(latest)))
    job = start_follow([*command, "--max-offsets-per-trigger", "12", "--idle-timeout", "60"], stderr=subprocess.PIPE,
                       text=True)
    seen: list[str] = []
    killed = threading.Event()

    def watch() -> None:
        assert job.stderr is not None
        for line in job.stderr:
            seen.append(line)
            if "batch 1: --sink appended" in line and not killed.is_set():
                os.killpg(job.pid, signal.SIGKILL)  # Python and the JVM it started, at once
                killed.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        assert killed.wait(300), "the follow job did not append micro-batch 1 within 300 s:\n" + "".join(seen[-30:])
        job.wait(30)
    finally:
        kill_follow(job)
    watcher.join(10)
    assert job.stderr is not None
    job.stderr.close()
    checkpoint = out / "checkpoint"
    # mid-batch indeed: micro-batch 1's sink commit is there, its MERGE and its state are not
    assert (_folded(checkpoint), _committed(sink), _committed(latest)) == ({0}, {0, 1}, {0}), "".join(seen[-30:])

    _produce_keys(messages, 31, 20)  # more while it was down
    # micro-batch 1 again (its offsets are in Spark's log), then the rest in one
    result = subprocess.run([*command, "--once"], cwd=ROOT, env=FOLLOW_ENV, capture_output=True, text=True,
                            timeout=600)
    report = json.loads((out / "report.json").read_text())
    assert result.returncode == 0, result.stderr[-3000:]
    assert report["run"]["batches_folded"][0] == 1  # micro-batch 1 again, from the state of micro-batch 0
    assert spark_latest(spark, latest) == rust_latest(latest) == newest_by_reference(messages.sent)
    assert spark_sink(spark, sink) == first_ids(messages.sent)
    assert (report["messages"], report["distinct_ids"], report["reversals"]) == (
        len(messages.sent), len(first_ids(messages.sent)), 0)
    folded = sorted(_folded(checkpoint) | {0, 1})
    for table in (sink, latest):  # one commit per micro-batch, none twice
        assert [label for _, label in history(spark, table)] == micro_batches(*range(folded[-1] + 1))
