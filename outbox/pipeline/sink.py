"""`--sink DIR`: the de-duplicated records as Parquet, partitioned by topic.

Each outbox id's first occurrence (lowest partition, then offset) with key, value, headers,
outbox id, create time, Kafka timestamp, partition and offset. The folder is overwritten as a
whole and rows are laid out by (topic, partition, offset), so the same input gives the same
dataset on every run.
"""

from __future__ import annotations

from pyspark.sql import DataFrame

from outbox.pipeline.audit import first_occurrences


def write(batch: DataFrame, path: str) -> None:
    """Write the first occurrences in `batch` (normalized messages) to `path`, replacing what was there."""
    records = first_occurrences(batch)
    (records.repartition("topic", "partition").sortWithinPartitions("topic", "partition", "offset")
     .write.mode("overwrite").partitionBy("topic").parquet(path))
