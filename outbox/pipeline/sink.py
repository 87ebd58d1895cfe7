"""`--sink DIR`: the de-duplicated records, partitioned by topic, as Parquet or a Delta table.

Each outbox id's first occurrence with key, value, headers, outbox id, create time, Kafka
timestamp, partition and offset. A batch audit replaces the whole table (lowest partition, then
offset, is an id's first occurrence), laid out by (topic, partition, offset), so the same input
gives the same dataset on every run.

In follow mode (Delta only: appending to plain Parquet files cannot be made exactly once) each
micro-batch appends the ids that no earlier micro-batch had, which the audit's state knows (its
id words), in one commit keyed by the micro-batch: an id is written once however often it is
published, and a micro-batch that Spark runs again after a crash appends nothing the second time.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from outbox.pipeline import delta_table
from outbox.pipeline import ids as id_words
from outbox.pipeline.audit import first_occurrences

FORMATS = ("parquet", delta_table.FORMAT)


def _laid_out(records: DataFrame) -> DataFrame:
    return records.repartition("topic", "partition").sortWithinPartitions("topic", "partition", "offset")


def write(batch: DataFrame, path: str, table_format: str = "parquet") -> None:
    """Write the first occurrences in `batch` (normalized messages) to `path`, replacing what was there."""
    records = _laid_out(first_occurrences(batch))
    if table_format == delta_table.FORMAT:
        delta_table.write(records, path, delta_table.Commit(), overwrite=True)
    else:
        records.write.mode("overwrite").partitionBy("topic").parquet(path)


def new_records(batch: DataFrame, seen: DataFrame | None) -> DataFrame:
    """The first occurrences in `batch` of ids that `seen` (id words per topic, of earlier batches) lacks."""
    records = first_occurrences(batch)
    if seen is None:
        return records
    words = seen.select(F.col("topic").alias("_seen_topic"), F.col("word").alias("_seen_word"),
                        F.col("bits").alias("_seen_bits"))
    joined = records.join(words, (F.col("topic") == F.col("_seen_topic"))
                          & (id_words.word_of(F.col("outbox_id")) == F.col("_seen_word")), "left")
    return joined.where(~id_words.contains(F.col("_seen_bits"), F.col("outbox_id"))).select(*records.columns)


def append(batch: DataFrame, seen: DataFrame | None, path: str, commit: delta_table.Commit) -> None:
    """Follow mode: add the ids of `batch` new to `seen` to the Delta table at `path`, in one commit.

    A first micro-batch (`seen` None: the checkpoint starts over) replaces whatever table was there.
    """
    delta_table.write(_laid_out(new_records(batch, seen)), path, commit, overwrite=seen is None)
