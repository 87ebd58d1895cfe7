"""`outbox_audit` end to end: topics with known content on the real Kafka, read by local Spark.

The audit runs in-process (cli.main / call_command) on one shared SparkSession; the exit-2
cases run `manage.py` and `python -m outbox.pipeline` in subprocesses (they fail before Spark), and
so does the follow run through a broker restart (with a Spark JVM of its own, on the spare broker).
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest
from django.core.management import call_command
from django.db import transaction

from outbox import stash_many
from outbox.harvest.config import HarvestConfig
from outbox.harvest.harvester import Harvester
from outbox.models import OutboxRecord
from tests.support.audit import (
    ROOT,
    Ledgered,
    audit,
    follow_command,
    harvested,
    in_order,
    kill_follow,
    newest_by_reference,
    produce,
    start_follow,
)
from tests.support.spark_session import shared_session
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.spark]

REQUIRED_KEYS = {"messages", "distinct_ids", "duplicates", "reversals", "missing", "latency_ms"}


@pytest.fixture(scope="session")
def spark():
    return shared_session()


def test_clean_ordered_streams_count_nothing(spark, bootstrap_servers, new_topic, tmp_path):
    orders, payments = new_topic("audit-clean"), new_topic("audit-clean")
    produce(bootstrap_servers, orders, in_order(0, "a", 1, 2, 5) + in_order(1, "b", 3, 4) + in_order(2, "c", 6))
    produce(bootstrap_servers, payments, in_order(3, "a", 7, 8, 9))
    code, report, stdout, _ = audit(spark, bootstrap_servers, tmp_path, "--topics", f"{orders},{payments}")

    assert code == 0
    assert set(report) >= REQUIRED_KEYS
    assert {k: report[k] for k in ("messages", "distinct_ids", "duplicates", "reversals", "missing")} == {
        "messages": 9, "distinct_ids": 9, "duplicates": 0, "reversals": 0, "missing": 0}
    assert report["without_headers"] == 0
    assert set(report["latency_ms"]) == {"p50", "p95", "p99"}
    assert 0 <= report["latency_ms"]["p50"] <= report["latency_ms"]["p95"] <= report["latency_ms"]["p99"] < 60_000
    assert report["topics"][orders]["messages"] == 6
    assert report["topics"][payments]["distinct_ids"] == 3
    assert report["run"]["offsets"][orders] == {"0": [0, 3], "1": [0, 2], "2": [0, 1], "3": [0, 0]}
    assert "result: OK" in stdout


def test_repeats_are_counted_exactly_and_are_not_reversals(spark, bootstrap_servers, new_topic, tmp_path):
    topic = new_topic("audit-repeats")
    produce(bootstrap_servers, topic, in_order(0, "k", 10, 11, 11, 12) + in_order(1, "j", 20, 20, 20, 21))
    code, report, _, _ = audit(spark, bootstrap_servers, tmp_path, "--topics", topic)

    assert code == 0
    assert (report["messages"], report["distinct_ids"], report["duplicates"], report["reversals"]) == (8, 5, 3, 0)
    repeats = {(e["partition"], e["offset"], e["outbox_id"], e["first_seen"]["offset"])
               for e in report["examples"]["duplicates"]}
    assert repeats == {(0, 2, 11, 1), (1, 1, 20, 0), (1, 2, 20, 0)}


def test_a_reversal_is_found_with_its_example(spark, bootstrap_servers, new_topic, tmp_path):
    topic = new_topic("audit-reversal")
    # k: 31 was never published before 32 (a reversal); j: a repeated run after a failure (duplicates).
    produce(bootstrap_servers, topic, in_order(2, "k", 30, 32, 31) + in_order(0, "j", 40, 41, 42, 41, 42, 43))
    code, report, stdout, _ = audit(spark, bootstrap_servers, tmp_path, "--topics", topic)

    assert code == 1
    assert (report["reversals"], report["duplicates"]) == (1, 2)
    assert report["examples"]["reversals"] == [
        {"topic": topic, "partition": 2, "offset": 2, "key": "k", "outbox_id": 31,
         "after": {"outbox_id": 32, "partition": 2, "offset": 1}}]
    assert "reversal: " in stdout and "id 31 after id 32 (offset 1)" in stdout
    assert "result: FAILED" in stdout


def test_a_missing_id_is_found_against_a_ledger_file(spark, bootstrap_servers, new_topic, tmp_path):
    topic = new_topic("audit-missing")
    produce(bootstrap_servers, topic, in_order(0, "k", 50, 51, 53))
    ledger = tmp_path / "ledger.txt"
    ledger.write_text("50\n51\n52\n\n53\n")
    code, report, _, _ = audit(spark, bootstrap_servers, tmp_path / "out", "--topics", topic, "--ledger", str(ledger))

    assert code == 1
    assert (report["missing"], report["examples"]["missing"]) == (1, [52])
    assert report["ledger"] == {"source": str(ledger), "ids": 4}


def test_a_missing_id_is_found_against_a_postgres_table(spark, bootstrap_servers, new_topic, database_url, tmp_path):
    """Through Spark's JDBC source; the management command takes the database from Django's settings."""
    topic = new_topic("audit-jdbc")
    produce(bootstrap_servers, topic, in_order(1, "k", 60, 62))
    table = f"audit_ledger_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url, autocommit=True) as connection:
        connection.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY)")
        connection.execute(f"INSERT INTO {table} SELECT generate_series(60, 62)")
    try:
        stdout, stderr = io.StringIO(), io.StringIO()
        with pytest.raises(SystemExit) as exited:
            call_command("outbox_audit", "--topics", topic, "--out", str(tmp_path), "--bootstrap-servers",
                         bootstrap_servers, "--ledger-table", table, stdout=stdout, stderr=stderr)
        report = json.loads((tmp_path / "report.json").read_text())
        assert exited.value.code == 1, stderr.getvalue()
        assert (report["missing"], report["examples"]["missing"], report["ledger"]["ids"]) == (1, [61], 3)

        parts = urlsplit(database_url)  # and the same with an explicit JDBC URL, as on a cluster
        url = f"jdbc:postgresql://{parts.hostname}:{parts.port or 5432}{parts.path}"
        code, report, _, _ = audit(spark, bootstrap_servers, tmp_path / "explicit", "--topics", topic,
                                   "--ledger-table", table, "--ledger-url", url,
                                   "--ledger-property", f"user={parts.username}",
                                   "--ledger-property", f"password={parts.password}")
        assert (code, report["missing"]) == (1, 1)
    finally:
        with psycopg.connect(database_url, autocommit=True) as connection:
            connection.execute(f"DROP TABLE {table}")


def test_messages_without_headers_are_reported(spark, bootstrap_servers, new_topic, tmp_path):
    topic = new_topic("audit-headers")
    produce(bootstrap_servers, topic, [
        harvested(0, "k", 70), harvested(0, "k", None), harvested(0, "k", 71, created=None),
        {"partition": 1, "key": "raw", "value": "no headers at all", "headers": None},
    ])
    code, report, _, _ = audit(spark, bootstrap_servers, tmp_path, "--topics", topic)

    assert code == 0
    assert (report["messages"], report["without_headers"], report["distinct_ids"]) == (4, 3, 2)
    assert sorted((e["partition"], e["offset"], e["problem"]) for e in report["examples"]["without_headers"]) == [
        (0, 1, "no outbox-id header"), (0, 2, "no outbox-create-time header"), (1, 0, "no outbox-id header")]


def test_follow_resumes_from_its_checkpoint_without_double_counting(spark, bootstrap_servers, new_topic, tmp_path):
    topic = new_topic("audit-follow")
    produce(bootstrap_servers, topic, in_order(0, "k", 1, 2, 2) + in_order(1, "j", 10))
    code, first, _, _ = audit(spark, bootstrap_servers, tmp_path, "--topics", topic, "--follow", "--once")
    assert (code, first["messages"], first["duplicates"]) == (0, 4, 1)

    # 0 was never published and is below k's 2 from the first run: a reversal; 1 and 10 are repeats.
    produce(bootstrap_servers, topic, in_order(0, "k", 0, 1) + in_order(1, "j", 10, 11))
    code, second, _, stderr = audit(spark, bootstrap_servers, tmp_path, "--topics", topic, "--follow",
                                    "--max-batches", "1", "--trigger-interval", "1 second")
    totals = {k: second[k] for k in ("messages", "distinct_ids", "duplicates", "reversals")}
    assert (code, totals) == (1, {"messages": 8, "distinct_ids": 5, "duplicates": 3, "reversals": 1}), stderr
    assert second["examples"]["reversals"][0]["offset"] == 3
    assert second["examples"]["reversals"][0]["after"] == {"outbox_id": 2, "partition": 0, "offset": 1}
    assert second["run"]["offsets"][topic] == {"0": [0, 5], "1": [0, 3], "2": [0, 0], "3": [0, 0]}

    # Spark replays a micro-batch whose commit it did not record (a crash after our state was saved).
    commits = tmp_path / "checkpoint" / "spark" / "commits"
    last = max(int(name.name) for name in commits.iterdir() if name.name.isdigit())
    assert second["run"]["batches_folded"] == [last]  # it stopped after Spark recorded the commit
    for name in (str(last), f".{last}.crc"):  # as if the process died before writing them
        (commits / name).unlink(missing_ok=True)
    code, replayed, _, stderr = audit(spark, bootstrap_servers, tmp_path, "--topics", topic, "--follow",
                                      "--idle-timeout", "2", "--trigger-interval", "1 second")
    assert code == 1
    assert replayed["run"]["batches_skipped"] == [last], stderr
    assert {k: replayed[k] for k in totals} == totals


def test_follow_stops_when_idle_counting_from_its_first_trigger(spark, bootstrap_servers, new_topic, tmp_path):
    """Nothing new since the last run: no batch at all, and the idle clock still runs and stops it."""
    topic = new_topic("audit-idle")
    produce(bootstrap_servers, topic, in_order(0, "k", 1, 2))
    code, first, _, _ = audit(spark, bootstrap_servers, tmp_path, "--topics", topic, "--follow", "--once")
    assert (code, first["messages"]) == (0, 2)
    began = time.monotonic()
    code, idle, _, stderr = audit(spark, bootstrap_servers, tmp_path, "--topics", topic, "--follow",
                                  "--idle-timeout", "2", "--trigger-interval", "1 second")
    assert (code, idle["messages"], idle["run"]["stopped"]) == (0, 2, "idle for 2s"), stderr
    assert (idle["run"]["batches_folded"], idle["run"]["batches_skipped"]) == ([], [])
    assert time.monotonic() - began < 120  # liveness only


def test_sink_twice_gives_the_same_dataset(spark, bootstrap_servers, new_topic, tmp_path):
    topic = new_topic("audit-sink")
    produce(bootstrap_servers, topic, in_order(1, "k", 80, 81) + in_order(0, "k", 81, 82) + in_order(1, "j", 83, 83)
            + [harvested(2, "x", None)])
    sink = tmp_path / "sink"
    snapshots = []
    for run in ("first", "second"):
        code, _, _, _ = audit(spark, bootstrap_servers, tmp_path / run, "--topics", topic, "--sink", str(sink))
        assert code == 0
        rows = spark.read.parquet(str(sink)).orderBy("topic", "partition", "offset").collect()
        files = sorted(p.relative_to(sink).parent for p in sink.rglob("*.parquet"))
        snapshots.append(([row.asDict(recursive=True) for row in rows], files))
    assert snapshots[0] == snapshots[1]
    rows = snapshots[0][0]
    assert [(r["partition"], r["offset"], r["outbox_id"]) for r in rows] == [(0, 0, 81), (0, 1, 82), (1, 0, 80),
                                                                           (1, 2, 83)]
    assert set(rows[0]) == {"topic", "partition", "offset", "timestamp", "key", "value", "headers", "outbox_id",
                            "create_time"}
    assert rows[0]["topic"] == topic and rows[0]["key"] == "k" and rows[0]["value"] == "v"
    assert {h["key"] for h in rows[0]["headers"]} == {"source", "outbox-id", "outbox-create-time"}
    assert all(p == Path(f"topic={topic}") for p in snapshots[0][1])


@pytest.mark.django_db(transaction=True)
def test_the_harvesters_own_output_passes(spark, database_url, bootstrap_servers, new_topic, tmp_path):
    topic = new_topic("audit-harvested")
    records = [{"topic": topic, "key": f"customer-{n % 7}", "value": {"n": n}} for n in range(300)]
    with transaction.atomic():
        ids = stash_many(records)
    name = f"audit-leader-{uuid.uuid4().hex[:8]}"
    harvester = Harvester(HarvestConfig(dsn=database_url, base_kafka_config={"bootstrap.servers": bootstrap_servers},
                                        leader_topic=name, leader_group=name))
    harvester.start()
    try:
        wait_until(lambda: not OutboxRecord.objects.exists(), 60, "the harvester to empty the outbox")
    finally:
        harvester.stop()
        harvester.wait()
    ledger = tmp_path / "ledger.txt"
    ledger.write_text("".join(f"{i}\n" for i in ids))

    stdout = io.StringIO()
    call_command("outbox_audit", "--topics", topic, "--out", str(tmp_path / "out"), "--bootstrap-servers",
                 bootstrap_servers, "--ledger", str(ledger), stdout=stdout, stderr=io.StringIO())  # exit 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["distinct_ids"] == 300
    assert report["messages"] == 300 + report["duplicates"]
    assert (report["reversals"], report["missing"], report["without_headers"]) == (0, 0, 0)
    assert "result: OK" in stdout.getvalue()


def run_command(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_unreachable_kafka_exits_2_with_one_line(tmp_path):
    result = run_command("manage.py", "outbox_audit", "--topics", "orders", "--out", str(tmp_path),
                         "--bootstrap-servers", "127.0.0.1:1", "--kafka-timeout", "3")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("outbox_audit: error: Kafka at 127.0.0.1:1 is unreachable")


@pytest.mark.parametrize("args", [
    ["--out", "x"],                                                       # no --topics
    ["--topics", "bad topic!", "--out", "x"],
    ["--topics", "t", "--out", "x", "--conf", "nokey"],
    ["--topics", "t", "--out", "x", "--once"],                            # follow-only flag
    ["--topics", "t", "--out", "x", "--follow", "--sink", "s"],                # follow mode: a Delta sink only
    ["--topics", "t", "--out", "x", "--format", "delta"],                    # a format for no table
    ["--topics", "t", "--out", "x", "--sink", "s", "--tombstones", "mark"],  # tombstones without --latest
    ["--topics", "t", "--out", "x", "--latest", "l", "--format", "orc"],
    ["--topics", "t", "--out", "x", "--ledger", "/no/such/ledger.txt"],
    ["--topics", "t", "--out", "x", "--ledger-url", "jdbc:postgresql://h/db"],
    ["--topics", "t", "--out", "x", "--max-batches", "0", "--follow"],
    ["--topics", "t", "--out", "x", "--master", "loca[2]"],
    ["--topics", "t", "--out", "/proc/outbox-audit"],                     # cannot be written
    ["--topics", "t", "--out", "x", "--sink", "x/sink"],                   # --sink would replace the report
    ["--topics", "t", "--out", "x", "--sink", "s", "--latest", "s"],
])


@pytest.mark.parametrize("command", [["manage.py", "outbox_audit"], ["-m", "outbox.pipeline"]])
def test_bad_arguments_exit_2_with_one_line(command, args):
    result = run_command(*command, *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert ": error: " in lines[0]


@pytest.mark.parametrize("option", ["--out", "--sink", "--latest", "--checkpoint"])
def test_a_folder_under_a_plain_file_exits_2_before_spark_starts(tmp_path, option):
    plain = tmp_path / "plain"
    plain.write_text("not a folder")
    args = ["--topics", "t", "--out", str(tmp_path / "out"), option, str(plain / "x")]
    if option == "--checkpoint":
        args.append("--follow")
    began = time.monotonic()
    result = run_command("-m", "outbox.pipeline", *args)
    assert (result.returncode, result.stderr.strip()) == (
        2, f"python -m outbox.pipeline: error: {option} {plain / 'x'}: cannot write there: Not a directory")
    assert time.monotonic() - began < 15  # no JVM was started, no message read


def test_a_bad_ledger_line_exits_2_before_spark_starts(tmp_path):
    ledger = tmp_path / "ids.txt"
    ledger.write_text("id\n1\n")
    result = run_command("manage.py", "outbox_audit", "--topics", "t", "--out", str(tmp_path), "--ledger", str(ledger))
    assert (result.returncode, result.stderr.strip()) == (
        2, f"outbox_audit: error: --ledger {ledger}: line 1 is not an outbox id: 'id'")


def test_an_unreachable_master_exits_2_with_its_cause_within_15_s(tmp_path):
    began = time.monotonic()
    result = run_command("manage.py", "outbox_audit", "--topics", "t", "--out", str(tmp_path),
                         "--master", "spark://127.0.0.1:1")
    assert time.monotonic() - began < 15
    assert (result.returncode, result.stderr.strip()) == (
        2, "outbox_audit: error: the Spark master spark://127.0.0.1:1 is unreachable: 127.0.0.1:1: Connection refused")


def test_a_port_that_is_not_a_spark_master_exits_2_with_one_line(bootstrap_servers, new_topic, tmp_path):
    """Something that accepts connections and says nothing (as a web UI or another service does to
    Spark's RPC): Spark alone would retry for a minute and end in stack traces."""
    listener = socket.create_server(("127.0.0.1", 0))
    held = []

    def hold() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=hold, daemon=True).start()
    master = f"spark://127.0.0.1:{listener.getsockname()[1]}"
    began = time.monotonic()
    try:
        result = run_command("manage.py", "outbox_audit", "--topics", new_topic("audit-master"), "--out",
                             str(tmp_path), "--bootstrap-servers", bootstrap_servers, "--master", master)
    finally:
        listener.close()
        for connection in held:
            connection.close()
    assert time.monotonic() - began < 60  # liveness only; about 10 s here: the JVM's start, then 5 s for the master
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == (f"outbox_audit: error: the Spark master {master} accepted a connection but did not register "
                    f"the audit within 5s: is that the master's port (7077 by default), not its web UI or another "
                    f"service?")
    assert "Exception" not in result.stderr and "\tat " not in result.stderr


def test_a_connector_for_another_spark_version_exits_2_with_one_line(tmp_path):
    for name in ("spark-sql-kafka-0-10_2.13-4.1.0.jar", "kafka-clients-3.9.2.jar"):
        (tmp_path / name).touch()
    result = run_command("-m", "outbox.pipeline", "--topics", "t", "--out", str(tmp_path / "out"),
                         env={"OUTBOX_SPARK_JARS": str(tmp_path)})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "spark-sql-kafka-0-10_2.13-4.1.0.jar is for Spark 4.1 but pyspark is 4.2." in lines[0]


@pytest.mark.parametrize("command", [["manage.py", "outbox_audit", "--help"], ["-m", "outbox.pipeline", "--help"],
                                     ["manage.py", "outbox_audit", "--topics", "t", "--out", "x"]])


def test_without_pyspark_one_line_names_the_extra(tmp_path, command):
    fake = tmp_path / "pyspark"  # shadows the installed pyspark, as if it were not installed
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'pyspark'\", name='pyspark')\n")
    result = run_command(*command, env={"PYTHONPATH": str(tmp_path)})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].endswith("install it with pip install 'django-outbox-harvest[spark]'")
    assert "No module named 'pyspark'" in lines[0]
    assert result.stdout == ""


def test_missing_jars_exit_2_saying_how_to_fetch_them(tmp_path):
    result = run_command("-m", "outbox.pipeline", "--topics", "t", "--out", str(tmp_path),
                         env={"OUTBOX_SPARK_JARS": str(tmp_path / "nothing-here")})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "bin/services up" in lines[0], result.stderr


def latest_table(spark, path: Path, topic: str) -> dict[str, tuple[str, int | None]]:
    rows = spark.read.parquet(str(path)).collect()
    assert {row["topic"] for row in rows} <= {topic}
    assert len(rows) == len({row["key"] for row in rows})  # one row per key
    return {row["key"]: (row["value"], row["outbox_id"]) for row in rows}


def test_latest_state_matches_a_plain_python_reference_across_a_restart(spark, bootstrap_servers, new_topic,
                                                                       tmp_path):
    topic = new_topic("audit-latest")
    messages = Ledgered(bootstrap_servers, topic)
    messages.send(
        (0, "a", 1, "a1"), (0, "a", 2, "a2"), (0, "a", 2, "a2"),      # a repeat
        (0, "b", 3, "b3"), (0, "b", 4, None),                         # deleted by a tombstone
        (1, "c", 5, "c5"), (1, "c", 7, "c7"), (1, "c", 6, "c6"),      # 6 reversed: 7 stays newest
        (1, "d", None, "d-plain"), (1, "d", 8, "d8"),                 # no outbox-id: offset order
        (2, "e", 9, "e9"), (2, "e", None, "e-plain"),
        (3, "f", 10, "f10"), (2, "f", 12, "f12"),                     # one key in two partitions
    )
    latest, batch_latest = tmp_path / "latest", tmp_path / "batch-latest"
    code, report, _, stderr = audit(spark, bootstrap_servers, tmp_path / "batch", "--topics", topic,
                                    "--latest", str(batch_latest))
    assert (code, report["reversals"], report["run"]["latest"]) == (1, 1, str(batch_latest)), stderr
    assert latest_table(spark, batch_latest, topic) == newest_by_reference(messages.sent)
    assert set(newest_by_reference(messages.sent)) == {"a", "c", "d", "e", "f"}

    follow = ["--topics", topic, "--follow", "--once", "--latest", str(latest)]
    code, _, _, stderr = audit(spark, bootstrap_servers, tmp_path / "follow", *follow)
    assert code == 1, stderr
    assert latest_table(spark, latest, topic) == newest_by_reference(messages.sent)

    messages.send(
        (0, "a", 1, "a1"),                                            # late repeats of older ids: never newest
        (0, "b", 3, "b3"),                                            # ... nor do they bring a deleted key back
        (1, "c", 11, "c11"),
        (1, "d", None, "d-plain-2"),
        (2, "e", 13, "e13"),
        (3, "g", 14, "g14"), (3, "g", 15, None),                      # created and deleted in one batch
        (0, "h", 16, None),                                           # a tombstone for a key never seen
        (0, "b", 17, "b17"),                                          # a new record after the tombstone
    )
    code, report, _, stderr = audit(spark, bootstrap_servers, tmp_path / "follow", *follow)  # resumes
    assert code == 1 and report["run"]["batches_folded"] and not report["run"]["batches_skipped"], stderr
    expected = newest_by_reference(messages.sent)
    assert expected == {"a": ("a2", 2), "b": ("b17", 17), "c": ("c11", 11), "d": ("d-plain-2", None),
                        "e": ("e13", 13), "f": ("f12", 12)}
    assert latest_table(spark, latest, topic) == expected

    code, _, _, stderr = audit(spark, bootstrap_servers, tmp_path / "batch", "--topics", topic,
                               "--latest", str(batch_latest))
    assert latest_table(spark, batch_latest, topic) == expected, stderr


def test_batch_and_follow_reports_have_one_shape_and_agree(spark, bootstrap_servers, new_topic, tmp_path):
    topic = new_topic("audit-shape")
    produce(bootstrap_servers, topic, in_order(0, "k", 1, 3, 2, 2) + in_order(1, "j", 5) + [harvested(2, "x", None)])
    code_batch, batch, _, _ = audit(spark, bootstrap_servers, tmp_path / "batch", "--topics", topic)
    code_follow, follow, _, _ = audit(spark, bootstrap_servers, tmp_path / "follow", "--topics", topic, "--follow",
                                      "--once")

    def shape(value):
        if isinstance(value, dict):
            return {key: shape(item) for key, item in value.items() if key != "run"}
        return type(value).__name__

    assert shape(batch) == shape(follow)
    assert set(batch["run"]) == set(follow["run"])
    assert batch["run"]["offsets"] == follow["run"]["offsets"] == {
        topic: {"0": [0, 4], "1": [0, 1], "2": [0, 1], "3": [0, 0]}}
    assert (batch["run"]["mode"], follow["run"]["mode"]) == ("batch", "follow")
    figures = ("messages", "distinct_ids", "duplicates", "reversals", "missing", "without_headers", "examples")
    assert {k: batch[k] for k in figures} == {k: follow[k] for k in figures}
    assert (code_batch, code_follow, batch["reversals"], batch["duplicates"]) == (1, 1, 1, 1)


@pytest.mark.slow
def test_follow_rides_through_a_restart_of_the_only_broker(spare_broker, tmp_path):
    """`--follow` against a broker that is stopped for a while and started again: the run goes on, and counts
    what was produced before and after the restart once each; SIGTERM then stops it with exit status 0. The audit
    runs as users start it, in a process with a Spark JVM of its own (so the test needs the spare broker's worker
    only, not the shared session's), with no idle timeout: nothing but the signal ends it.
    Slow: a Spark JVM's start, and the broker stopped for a while."""
    spare_broker.up()
    bootstrap = spare_broker.bootstrap_servers
    topic = spare_broker.create_topic("audit-restart", partitions=2)
    produce(bootstrap, topic, in_order(0, "k", 1, 2, 3) + in_order(1, "j", 10, 11))
    out, log = tmp_path / "out", tmp_path / "audit.log"

    def counted() -> int | None:
        """The messages the report counts so far (rewritten after each micro-batch), or None before the first."""
        report = out / "report.json"
        return json.loads(report.read_text())["messages"] if report.exists() else None

    with log.open("w") as stderr:
        job = start_follow(follow_command(bootstrap, out, topic), stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        wait_until(lambda: (counted() or 0) >= 5 or job.poll() is not None, 180, "the messages sent before the restart")
        assert job.poll() is None, log.read_text()[-3000:]
        spare_broker.stop(1)
        time.sleep(16)  # the outage itself
        assert job.poll() is None, f"the follow run ended while the broker was down:\n{log.read_text()[-3000:]}"
        spare_broker.up()
        produce(bootstrap, topic, in_order(0, "k", 4) + in_order(1, "j", 12, 13))
        wait_until(lambda: (counted() or 0) >= 8 or job.poll() is not None, 180, "the messages sent after the restart")
        job.send_signal(signal.SIGTERM)  # stops after the micro-batch under way, as a deployment's stop would
        code = job.wait(timeout=120)
    finally:
        spare_broker.up()
        kill_follow(job)
    stderr = log.read_text()
    report = json.loads((out / "report.json").read_text())
    assert code == 0 and "stopped: signal" in stderr, stderr
    assert (report["messages"], report["distinct_ids"], report["duplicates"], report["missing"]) == (8, 8, 0, 0), \
        stderr
