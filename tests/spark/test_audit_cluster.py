"""`outbox_audit` on a Spark standalone cluster started from the pyspark install, as docs/audit.md says.

One master and one worker of one core (`bin/spark-class`, the pip package's only way to start
them), the audit in a subprocess with only `--master` changed: the same report as `local[2]`, and
the cluster's shuffle partitions chosen from its cores.

Slow: a master and a worker JVM, and for each audit a driver and an executor JVM of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyspark
import pytest

from tests.support.audit import ROOT, audit, harvested, in_order, produce
from tests.support.services import free_port
from tests.support.spark_session import shared_session

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.slow]

SPARK_CLASS = Path(pyspark.__file__).parent / "bin" / "spark-class"


def _wait_for_line(log: Path, text: str, process: subprocess.Popen[bytes], timeout: float) -> str:
    """The first line of `log` that contains `text`, once it is there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [line for line in log.read_text(errors="replace").splitlines() if text in line] if log.exists() else []
        if found:
            return found[0]
        if process.poll() is not None:
            raise AssertionError(f"{log.name}: the process exited ({process.returncode}):\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} in {log} within {timeout:g}s:\n{log.read_text(errors='replace')[-2000:]}")


@pytest.fixture(scope="module")
def spark():
    return shared_session()


@pytest.fixture(scope="module")
def standalone_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """spark://127.0.0.1:PORT of a running master with one registered one-core worker."""
    folder = tmp_path_factory.mktemp("spark-standalone")
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_WORKER_DIR": str(folder / "work")}
    started: list[subprocess.Popen[bytes]] = []

    def start(name: str, args: list[str], ready: str) -> str:
        log = folder / f"{name}.log"
        with log.open("wb") as output:
            started.append(subprocess.Popen([str(SPARK_CLASS), *args], stdout=output, stderr=subprocess.STDOUT,
                                            env=env))
        return _wait_for_line(log, ready, started[-1], timeout=90)

    try:
        # Spark moves to the next port if this one was taken meanwhile: the master's log says where it is.
        line = start("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port",
                                str(free_port()), "--webui-port", str(free_port())], "Starting Spark master at ")
        url = line.split("Starting Spark master at ", 1)[1].strip()
        start("worker", ["org.apache.spark.deploy.worker.Worker", "--cores", "1", "--memory", "1g", "--webui-port",
                         str(free_port()), url], "Successfully registered with master")
        yield url
    finally:
        for process in reversed(started):  # the worker, then the master; SIGTERM stops a JVM in seconds
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_a_standalone_cluster_gives_the_local_report(spark, standalone_master, bootstrap_servers, new_topic,
                                                     tmp_path):
    topic = new_topic("audit-cluster")
    produce(bootstrap_servers, topic, in_order(0, "k", 1, 3, 2, 2) + in_order(1, "j", 5, 6, 7, 6, 7, 8)
            + in_order(2, "i", 10, 11) + [harvested(3, "x", None)])
    _, local, _, _ = audit(spark, bootstrap_servers, tmp_path / "local", "--topics", topic)

    out = tmp_path / "cluster"
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "outbox.pipeline", "--topics", topic, "--out", str(out), "--bootstrap-servers",
         bootstrap_servers, "--master", standalone_master, "--executor-timeout", "90"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})
    assert result.returncode == 1, result.stderr[-3000:]  # the reversal of k
    # one core, but Spark's default parallelism is never below 2: 4 shuffle partitions a unit of it
    chosen = "1 executor(s), default parallelism 2; spark.sql.shuffle.partitions=8"
    assert chosen in result.stderr, result.stderr[-3000:]
    cluster = json.loads((out / "report.json").read_text())
    figures = ("messages", "distinct_ids", "duplicates", "reversals", "missing", "without_headers", "latency_ms",
               "topics", "examples")
    assert {k: cluster[k] for k in figures} == {k: local[k] for k in figures}
    assert (cluster["messages"], cluster["reversals"], cluster["duplicates"]) == (13, 1, 3)
    assert cluster["run"]["master"] == standalone_master
    assert time.monotonic() - began < 240  # liveness only: no wait on resources that never come


def test_delta_tables_on_a_standalone_cluster_match_the_reference(spark, standalone_master, bootstrap_servers,
                                                                  new_topic, tmp_path):
    """Follow mode with Delta tables, the executors on the cluster writing them: a WRITE, then a MERGE."""
    from tests.support.audit import (
        FIRST,
        Ledgered,
        first_ids,
        history,
        micro_batches,
        newest_by_reference,
        spark_latest,
        spark_sink,
    )

    topic = new_topic("audit-cluster-delta")
    messages = Ledgered(bootstrap_servers, topic)
    messages.send(*FIRST)
    sink, latest = tmp_path / "sink", tmp_path / "latest"
    result = subprocess.run(
        [sys.executable, "-m", "outbox.pipeline", "--topics", topic, "--out", str(tmp_path / "out"),
         "--bootstrap-servers", bootstrap_servers, "--master", standalone_master, "--executor-timeout", "90",
         "--follow", "--once", "--max-offsets-per-trigger", "8", "--format", "delta", "--sink", str(sink),
         "--latest", str(latest)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})
    assert result.returncode == 1, result.stderr[-3000:]  # the reversal of c
    assert spark_latest(spark, latest) == newest_by_reference(messages.sent)
    assert spark_sink(spark, sink) == first_ids(messages.sent)
    assert history(spark, latest) == [("WRITE", micro_batches(0)[0]), ("MERGE", micro_batches(1)[0])]
