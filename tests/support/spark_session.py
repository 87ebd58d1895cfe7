"""One local SparkSession for every test that needs Spark (start-up costs seconds, so it is shared).

It carries the Kafka connector's jars when they can be found (see outbox/pipeline/jars.py), and
Delta Lake's extension when its jar and the delta-spark package are there, so the integration
tests and `outbox_audit` run in-process use the same session: the audit finds it running and
leaves it running.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import sys

from pyspark.sql import SparkSession

from outbox.pipeline import jars, session


@functools.cache
def shared_session() -> SparkSession:
    try:
        found = jars.resolve()
    except jars.JarsNotFound:
        found = []
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName("outbox-tests").master("local[2]")
    confs = {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "4", "spark.driver.memory": "2g"}
    delta = jars.has_delta(found) and importlib.util.find_spec("delta") is not None
    for key, value in session.settings("local[2]", confs, found, delta=delta).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    atexit.register(spark.stop)
    return spark
