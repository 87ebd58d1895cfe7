"""The SparkSession: `--master`, `--conf` and the jars, with defaults that suit the master.

Python workers (which run the per-key checks of scan.py) use this interpreter unless
`PYSPARK_PYTHON` or `spark.pyspark.python` says otherwise. On a `local[...]` master the driver
binds to 127.0.0.1 and shuffles use a few partitions. On a cluster master the shuffle
partitions follow the cores the cluster offers once its executors registered (`cluster_defaults`)
instead of Spark's 200, which on a small cluster cost more in task overhead than the work itself.
Every default yields to an explicit `--conf` (or spark-submit's). When a session is already
running (spark-submit, a notebook, the tests) it is used as it is, and left running at the end.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from pyspark.sql import SparkSession

APP_NAME = "outbox-audit"
LOCAL_DEFAULTS = {
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.driver.memory": "4g",
    "spark.sql.shuffle.partitions": "8",
    "spark.ui.showConsoleProgress": "true",
}
SHUFFLE_PARTITIONS_PER_CORE = 4  # as local[2] with its 8: enough to spread skew, few enough to stay cheap


# For every master. Kafka's batch reads go through its DataSource V2 scan, which hands Spark its rows
# directly instead of through external Row objects (15-20% less time reading); the Arrow batches
# sent to the per-key checks are bounded by their row count only, since checking a byte bound
# measures the whole batch after every row (a tenth of the pass).
DEFAULTS = {
    "spark.ui.showConsoleProgress": "true",
    "spark.sql.sources.useV1SourceList": "avro,csv,json,orc,parquet,text",
    "spark.sql.execution.arrow.maxBytesPerBatch": str(2**31 - 1),
}


# `--format delta`: Delta Lake's SQL extension (MERGE, DESCRIBE HISTORY, OPTIMIZE, VACUUM) and catalog. Each
# new snapshot of a table is read from its log in this many tasks: Delta's default of 50 made a 10,000-key
# MERGE into a 1,000,000-row table on local[2] three times slower (docs/benchmarks.md).
DELTA_EXTENSION = "io.delta.sql.DeltaSparkSessionExtension"
DELTA_CATALOG = "org.apache.spark.sql.delta.catalog.DeltaCatalog"
DELTA_DEFAULTS = {
    "spark.sql.catalog.spark_catalog": DELTA_CATALOG,
    "spark.databricks.delta.snapshotPartitions": "2",
}


def settings(master: str | None, confs: Mapping[str, str], jars: Sequence[str],
             delta: bool = False) -> dict[str, str]:
    """Every Spark setting the audit asks for, defaults first so that `confs` wins.

    With `delta`, Delta Lake's extension is added to any `spark.sql.extensions` given, not replaced by it.
    """
    merged: dict[str, str] = dict(DEFAULTS)
    if master is not None and master.startswith("local"):
        merged.update(LOCAL_DEFAULTS)
    if delta:
        merged.update(DELTA_DEFAULTS)
    if jars:
        merged["spark.jars"] = ",".join(jars)
    merged.update(confs)
    if delta:
        extensions = [name.strip() for name in merged.get("spark.sql.extensions", "").split(",") if name.strip()]
        merged["spark.sql.extensions"] = ",".join([*extensions, DELTA_EXTENSION] if DELTA_EXTENSION not in extensions
                                                  else extensions)
    return merged


def has_delta(spark: SparkSession) -> bool:
    """Whether a running session was started with Delta Lake's SQL extension."""
    extensions = spark.sparkContext.getConf().get("spark.sql.extensions", "") or ""
    return DELTA_EXTENSION in extensions.split(",")


REGISTRATION_TIMEOUT = 5.0  # seconds a spark:// master gets to register the audit; a real one takes milliseconds


def _waiting_for_master() -> bool:
    """Whether this process's JVM is waiting for a standalone master to register it (asked through py4j).

    One look at every thread's top frames (a `ThreadInfo` shows eight): Spark's
    `StandaloneSchedulerBackend.waitForRegistration`, five frames under the semaphore's wait.
    """
    from pyspark import SparkContext

    jvm = SparkContext._jvm
    if jvm is None:
        return False
    threads = jvm.java.lang.management.ManagementFactory.getThreadMXBean().dumpAllThreads(False, False)
    return any("StandaloneSchedulerBackend.waitForRegistration" in info.toString() for info in threads)


@contextmanager
def _registration_watch(master: str | None, on_stuck: Callable[[str], None] | None,
                        timeout: float = REGISTRATION_TIMEOUT) -> Iterator[None]:
    """Call `on_stuck` with one line when a spark:// master has not registered the application in time.

    Something that accepts connections but is not a Spark master (its web UI's port, another
    service) leaves Spark retrying for a minute before a wall of stack traces. Only the time the
    JVM spends waiting for the registration counts, so neither a slow JVM start nor the wait for
    executors that follows is mistaken for a silent master.
    `on_stuck` is expected to end the process (the main thread is blocked inside Spark).
    """
    if on_stuck is None or master is None or not master.startswith("spark://"):
        yield
        return
    done = threading.Event()

    def watch() -> None:
        began = None
        while not done.wait(0.25):
            try:
                waiting = _waiting_for_master()
            except Exception:  # the gateway is not up yet
                continue
            if waiting and began is None:
                began = time.monotonic()
            elif not waiting and began is not None:
                return  # registered; executors are wait_for_executors' business
            if began is not None and time.monotonic() - began > timeout:
                on_stuck(f"the Spark master {master} accepted a connection but did not register the audit "
                         f"within {timeout:g}s: is that the master's port (7077 by default), not its web UI "
                         f"or another service?")
                return

    watcher = threading.Thread(target=watch, name="outbox-audit-registration-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


@contextmanager
def spark_session(master: str | None, confs: Mapping[str, str], jars: Sequence[str],
                  log_level: str = "WARN", on_stuck: Callable[[str], None] | None = None,
                  delta: bool = False) -> Iterator[SparkSession]:
    """A running session for the audit; stopped afterwards only if it was started here.

    `on_stuck`: see `_registration_watch`; `delta`: with Delta Lake's extension (see `settings`).
    """
    existing = SparkSession.getActiveSession()
    builder = SparkSession.builder.appName(APP_NAME)
    if existing is None:
        if master is not None and master.startswith("local"):
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # the JVM inherits it; no guessing an interface
        if master is not None and "spark.pyspark.python" not in confs:
            # Executors run the per-key checks (scan.py) in Python: by default this interpreter, which has
            # numpy and pyarrow, rather than whatever `python3` a worker finds (docs/audit.md).
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        if master is not None:  # None: spark-submit's --master
            builder = builder.master(master)
        for key, value in settings(master, confs, jars, delta=delta).items():
            builder = builder.config(key, value)
    with _registration_watch(master if existing is None else None, on_stuck):
        spark = builder.getOrCreate()
    if existing is None:
        spark.sparkContext.setLogLevel(log_level)
    else:
        for key, value in confs.items():  # runtime (SQL) settings still apply to a running session
            if spark.conf.isModifiable(key):
                spark.conf.set(key, value)
    try:
        yield spark
    finally:
        if existing is None:
            spark.stop()


def cluster_defaults(spark: SparkSession, confs: Mapping[str, str], parallelism: int) -> dict[str, str]:
    """On a cluster master, shuffle partitions from its `parallelism` (its cores, at least 2) unless given.

    Returns what was set.
    """
    key = "spark.sql.shuffle.partitions"
    if key in confs or spark.sparkContext.getConf().contains(key):
        return {}
    value = str(SHUFFLE_PARTITIONS_PER_CORE * max(1, parallelism))
    spark.conf.set(key, value)
    return {key: value}
