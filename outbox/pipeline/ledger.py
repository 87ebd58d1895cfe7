"""Ledgers of expected outbox ids, for `missing`: a text file, or a table read through JDBC.

Both become a frame with one bigint column `outbox_id`. The file has one id a line (blank lines
are skipped); the table is read with Spark's JDBC source, so on a cluster the executors read it.
"""

from __future__ import annotations

from collections.abc import Mapping

from py4j.protocol import Py4JJavaError
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from outbox.reasons import first_line

DRIVERS = {"jdbc:postgresql:": "org.postgresql.Driver"}


class LedgerError(Exception):
    """A one-line reason why the ledger cannot be read."""


def _reason(error: Exception) -> str:
    if isinstance(error, Py4JJavaError):
        text = str(error.java_exception.getMessage() or error.java_exception.toString())
    else:
        text = str(error)
    return first_line(text) if text.strip() else type(error).__name__


def from_file(spark: SparkSession, path: str) -> DataFrame:
    """One id a line; LedgerError on a line that is not an integer."""
    try:
        lines = spark.read.text(path).select(F.trim("value").alias("line")).where(F.col("line") != "")
        ids = lines.select("line", F.col("line").try_cast("bigint").alias("outbox_id"))
        bad = ids.where(F.col("outbox_id").isNull()).limit(1).collect()
    except (PySparkException, Py4JJavaError) as error:
        raise LedgerError(f"ledger {path}: {_reason(error)}") from None
    if bad:
        raise LedgerError(f"ledger {path}: not an outbox id: {bad[0]['line']!r}")
    return ids.select("outbox_id")


def from_jdbc(spark: SparkSession, url: str, table: str, column: str = "id",
              properties: Mapping[str, str] | None = None) -> DataFrame:
    """Column `column` of `table` (or of a subquery written `(SELECT ...) AS t`) at JDBC `url`."""
    reader = spark.read.format("jdbc").option("url", url).option("dbtable", table)
    driver = next((name for prefix, name in DRIVERS.items() if url.startswith(prefix)), None)
    if driver:
        reader = reader.option("driver", driver)
    for key, value in (properties or {}).items():
        reader = reader.option(key, value)
    try:
        frame = reader.load()
        return frame.select(F.col(column).cast("bigint").alias("outbox_id"))
    except (PySparkException, Py4JJavaError) as error:
        raise LedgerError(f"ledger table {table}: {_reason(error)}") from None
