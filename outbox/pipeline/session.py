"""The SparkSession: `--master`, `--conf` and the jars, with defaults that suit the master.

On a `local[...]` master the driver binds to 127.0.0.1, Python workers (should any be needed: the
checks themselves are SQL expressions, run in the JVM) use this interpreter and shuffles use a
few partitions (adaptive execution merges them further). On a cluster master the shuffle
partitions follow the cores the cluster offers once its executors registered (`cluster_defaults`)
instead of Spark's 200, which on a small cluster cost more in task overhead than the work itself.
Every default yields to an explicit `--conf` (or spark-submit's). When a session is already
running (spark-submit, a notebook, the tests) it is used as it is, and left running at the end.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping, Sequence
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


def settings(master: str | None, confs: Mapping[str, str], jars: Sequence[str]) -> dict[str, str]:
    """Every Spark setting the audit asks for, defaults first so that `confs` wins."""
    merged: dict[str, str] = {"spark.ui.showConsoleProgress": "true"}
    if master is not None and master.startswith("local"):
        merged.update(LOCAL_DEFAULTS)
    if jars:
        merged["spark.jars"] = ",".join(jars)
    merged.update(confs)
    return merged


@contextmanager
def spark_session(master: str | None, confs: Mapping[str, str], jars: Sequence[str],
                  log_level: str = "WARN") -> Iterator[SparkSession]:
    """A running session for the audit; stopped afterwards only if it was started here."""
    existing = SparkSession.getActiveSession()
    builder = SparkSession.builder.appName(APP_NAME)
    if existing is None:
        if master is not None and master.startswith("local"):
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # the JVM inherits it; no guessing an interface
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # workers on this interpreter's version
        if master is not None:  # None: spark-submit's --master
            builder = builder.master(master)
        for key, value in settings(master, confs, jars).items():
            builder = builder.config(key, value)
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
