"""`--format delta`: the audit's tables as Delta Lake tables, one commit per write.

Delta keeps a transaction log beside the Parquet files: a reader sees a table as of a commit,
never half of one, and `DESCRIBE HISTORY` lists the commits. Every commit the audit makes carries
`userMetadata` saying which run or micro-batch made it. In follow mode each write also carries
Delta's transaction identifiers (the streaming query's id, which its checkpoint keeps, and the
micro-batch id): a micro-batch that Spark runs again after a crash finds its commit already in the
log and writes nothing, so a table gets exactly one commit per micro-batch.

The `delta` package (delta-spark) is imported only here, and only when a table is merged into.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame, SparkSession

FORMAT = "delta"
EXTRA = "pip install 'django-outbox-harvest[delta]'"
# The SQL settings that make a MERGE idempotent and label its commit (Delta's DataFrameWriter options
# txnAppId, txnVersion and userMetadata do the same for writes).
_TXN_APP_ID = "spark.databricks.delta.write.txnAppId"
_TXN_VERSION = "spark.databricks.delta.write.txnVersion"
_USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"
_MATERIALIZE_SOURCE = "spark.databricks.delta.merge.materializeSource"


def package_missing() -> str | None:
    """One line saying how to install delta-spark when it is not installed, else None."""
    if importlib.util.find_spec("delta") is None:
        return f"--format delta needs the delta-spark package; install it with {EXTRA}"
    return None


@dataclass(frozen=True)
class Commit:
    """Who writes: a batch audit (`app_id` None) or micro-batch `batch_id` of streaming query `app_id`."""

    app_id: str | None = None
    batch_id: int = 0

    @property
    def label(self) -> str:
        return "outbox-audit batch run" if self.app_id is None else f"outbox-audit micro-batch {self.batch_id}"


def write(frame: DataFrame, path: str, commit: Commit, *, overwrite: bool,
          properties: Mapping[str, str] | None = None) -> None:
    """Append `frame` to the table at `path` (created if need be), or replace its content, in one commit.

    `properties` (e.g. `delta.enableDeletionVectors`) apply when the write creates the table.
    """
    writer = (frame.write.format(FORMAT).mode("overwrite" if overwrite else "append").partitionBy("topic")
              .option("userMetadata", commit.label))
    if overwrite:
        writer = writer.option("overwriteSchema", "true")  # a table left by an earlier checkpoint or flag
    if commit.app_id is not None:
        writer = writer.option("txnAppId", commit.app_id).option("txnVersion", str(commit.batch_id))
    for key, value in (properties or {}).items():
        writer = writer.option(key, value)
    writer.save(path)


def exists(spark: SparkSession, path: str) -> bool:
    from delta.tables import DeltaTable

    return bool(DeltaTable.isDeltaTable(spark, path))


def table(spark: SparkSession, path: str) -> Any:
    """delta.tables.DeltaTable of `path` (for merge builders)."""
    from delta.tables import DeltaTable

    return DeltaTable.forPath(spark, path)


@contextmanager
def transaction(spark: SparkSession, commit: Commit, *, materialized_source: bool = False) -> Iterator[None]:
    """The DML (MERGE) run inside is labelled with `commit`, and skipped if that micro-batch committed already.

    `materialized_source`: the MERGE's source is materialized already, so Delta need not copy it first.
    """
    settings = {_USER_METADATA: commit.label}
    if materialized_source:
        settings[_MATERIALIZE_SOURCE] = "none"
    if commit.app_id is not None:
        settings.update({_TXN_APP_ID: commit.app_id, _TXN_VERSION: str(commit.batch_id)})
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key in settings:
            spark.conf.unset(key)
