"""The follow mode's state: one version of `AuditState` per folded micro-batch, on any Hadoop FS.

Layout under the state folder:

    batch-000000000007/{counters,ids,keys,latency,examples}/   Parquet
    batch-000000000007/_FOLDED                                  written last

A version counts only once `_FOLDED` exists. Structured Streaming may run a micro-batch again
after a crash (same id, same offsets) when its state was saved but its commit was not: such a
batch finds its version folded and is skipped, so nothing is counted twice. A batch that died
half-way has no marker, and is folded again from the previous version. Older versions are
deleted once a newer one is folded.
"""

from __future__ import annotations

from typing import Any

from pyspark.sql import SparkSession

from outbox.pipeline.audit import AuditState

PREFIX = "batch-"
MARKER = "_FOLDED"


class StateStore:
    def __init__(self, spark: SparkSession, root: str, keep: int = 2) -> None:
        self.spark = spark
        self.root = root.rstrip("/")
        self.keep = keep
        jvm: Any = spark.sparkContext._jvm
        self._path = jvm.org.apache.hadoop.fs.Path
        self._fs = self._path(self.root).getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())

    def _version(self, batch_id: int) -> str:
        return f"{self.root}/{PREFIX}{batch_id:012d}"

    def folded(self, batch_id: int) -> bool:
        return bool(self._fs.exists(self._path(f"{self._version(batch_id)}/{MARKER}")))

    def versions(self) -> list[int]:
        """Ids of the folded batches still kept, oldest first."""
        root = self._path(self.root)
        if not self._fs.exists(root):
            return []
        names = [status.getPath().getName() for status in self._fs.listStatus(root)]
        ids = [int(name.removeprefix(PREFIX)) for name in names if name.startswith(PREFIX)]
        return sorted(batch_id for batch_id in ids if self.folded(batch_id))

    def latest(self, before: int | None = None) -> tuple[int, AuditState] | None:
        """The newest folded version (older than `before` when given) and its state."""
        ids = [batch_id for batch_id in self.versions() if before is None or batch_id < before]
        if not ids:
            return None
        return ids[-1], self.load(ids[-1])

    def load(self, batch_id: int) -> AuditState:
        version = self._version(batch_id)
        read = self.spark.read
        return AuditState(**{name: read.schema(schema).parquet(f"{version}/{name}")
                             for name, schema in AuditState.SCHEMAS.items()})

    def save(self, batch_id: int, state: AuditState) -> AuditState:
        """Write `state` as version `batch_id`, mark it folded, drop old versions; returns it re-read."""
        version = self._version(batch_id)
        self._fs.delete(self._path(version), True)  # a half-written earlier attempt
        for name, frame in state.tables().items():
            frame.write.mode("overwrite").parquet(f"{version}/{name}")
        self._fs.create(self._path(f"{version}/{MARKER}"), True).close()
        for old in self.versions()[:-self.keep]:
            self._fs.delete(self._path(self._version(old)), True)
        return self.load(batch_id)
