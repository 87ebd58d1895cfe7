"""The follow mode's state: one version of `AuditState` per folded micro-batch, on any Hadoop FS.

Layout under the state folder:

    batch-000000000007/{counters,ids,keys,latency,examples[,latest]}/   Parquet
    batch-000000000007/_FOLDED                                         written last

A version counts only once `_FOLDED` exists; the marker holds the state's format, the tables it
has, the Kafka offsets the state covers and the outputs kept in step with it (`Outputs`: which
tables, in which format, where), so that a restart cannot silently add an output that would miss
what earlier micro-batches wrote. Structured Streaming may run a micro-batch again
after a crash (same id, same offsets) when its state was saved but its commit was not: such a
batch finds its version folded and is skipped, so nothing is counted twice. A batch that died
half-way has no marker, and is folded again from the previous version. Older versions are
deleted once a newer one is folded.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from pyspark.sql import SparkSession

from outbox.pipeline.audit import AuditState

PREFIX = "batch-"
MARKER = "_FOLDED"
FORMAT = 2  # 1: ids as 4 KiB bitmaps (before ids.py), no marker content

Offsets = dict[str, dict[str, list[int]]]


class StateError(Exception):
    """A one-line reason why the saved state cannot be used."""


@dataclass(frozen=True)
class Outputs:
    """The tables a follow run keeps in step with its state: format and folder of each (None: not kept).

    A Parquet `--latest` is rewritten from the state, so only its format matters; a Delta table holds
    what earlier micro-batches wrote, so its folder must stay the same too.
    """

    sink: str | None = None
    sink_format: str | None = None
    latest: str | None = None
    latest_format: str | None = None
    tombstones: str = "delete"

    @classmethod
    def of(cls, marker: dict[str, Any]) -> Outputs:
        """From a marker; one written before outputs were recorded kept at most a Parquet --latest."""
        if "outputs" in marker:
            return cls(**marker["outputs"])
        return cls(latest_format="parquet" if "latest" in marker.get("tables", []) else None)


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

    def latest(self, before: int | None = None) -> tuple[int, AuditState, Offsets] | None:
        """The newest folded version (older than `before` when given): its id, state and offsets."""
        ids = [batch_id for batch_id in self.versions() if before is None or batch_id < before]
        if not ids:
            return None
        return ids[-1], *self.load(ids[-1])

    def _read_text(self, path: str) -> str:
        stream = self._fs.open(self._path(path))
        try:
            return bytes(self.spark.sparkContext._jvm.org.apache.commons.io.IOUtils.toByteArray(stream)).decode()
        finally:
            stream.close()

    def _marker(self, batch_id: int) -> dict[str, Any]:
        text = self._read_text(f"{self._version(batch_id)}/{MARKER}")
        marker = json.loads(text) if text.strip() else {"format": 1}
        if marker.get("format") != FORMAT:
            raise StateError(f"the state in {self.root} was written by an older version of the audit; "
                             f"delete the checkpoint folder to start over")
        return marker

    def outputs(self, batch_id: int) -> Outputs:
        return Outputs.of(self._marker(batch_id))

    def query_id(self, checkpoint: str) -> str:
        """The id of the streaming query of Spark's checkpoint `checkpoint` (written when the query starts).

        It stays the same across restarts on that checkpoint and is new for a new one: the Delta
        tables' transaction identifier (delta_table.py).
        """
        return str(json.loads(self._read_text(f"{checkpoint.rstrip('/')}/metadata"))["id"])

    def load(self, batch_id: int) -> tuple[AuditState, Offsets]:
        marker = self._marker(batch_id)
        version = self._version(batch_id)
        read = self.spark.read
        tables = {name: read.schema(AuditState.SCHEMAS[name]).parquet(f"{version}/{name}")
                  for name in marker["tables"]}
        return AuditState(**tables), marker.get("offsets", {})

    def save(self, batch_id: int, state: AuditState, offsets: Offsets,
             before_marking: Callable[[AuditState], None] | None = None,
             outputs: Outputs | None = None) -> AuditState:
        """Write `state` as version `batch_id`, mark it folded, drop old versions; returns it re-read.

        `before_marking` sees the written state before the marker exists: what it writes (the
        tables of `outputs`) is then redone if the process dies before the version counts.
        """
        version = self._version(batch_id)
        self._fs.delete(self._path(version), True)  # a half-written earlier attempt
        tables = state.tables()
        for name, frame in tables.items():
            frame.write.mode("overwrite").parquet(f"{version}/{name}")
        read = self.spark.read
        saved = AuditState(**{name: read.schema(AuditState.SCHEMAS[name]).parquet(f"{version}/{name}")
                              for name in tables})
        if before_marking is not None:
            before_marking(saved)
        marker = json.dumps({"format": FORMAT, "tables": list(tables), "offsets": offsets,
                             "outputs": asdict(outputs or Outputs())})
        out = self._fs.create(self._path(f"{version}/{MARKER}"), True)
        try:
            out.write(bytearray(marker.encode()))
        finally:
            out.close()
        for old in self.versions()[:-self.keep]:
            self._fs.delete(self._path(self._version(old)), True)
        return saved

    def spark_offsets(self, checkpoint: str, batch_id: int) -> dict[str, dict[str, int]] | None:
        """The Kafka offsets Spark's offset log gives as the end of micro-batch `batch_id` (None: not there).

        The log (`<checkpoint>/offsets/<id>`) is written before the batch runs: a version line,
        a metadata line, then one line per source, here the Kafka source's `{topic: {partition: offset}}`.
        """
        path = f"{checkpoint.rstrip('/')}/offsets/{batch_id}"
        if not self._fs.exists(self._path(path)):
            return None
        lines = [line for line in self._read_text(path).splitlines() if line.strip()]
        return json.loads(lines[2]) if len(lines) >= 3 else None
