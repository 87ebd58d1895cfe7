"""`--latest DIR`: the newest record of every key, as a compacted topic would hold it, but queryable.

Which record is a key's newest follows the ordering rule of the audit itself: the one with the
highest outbox id, so that a late repeat of an older id (which at-least-once delivery allows)
never wins, and neither does a reversal. Messages without an `outbox-id` header fall back to
offset order: such a message is newer than everything before it in its partition and older than
the next message with a higher id than the key had. A key found in several partitions (a topic
whose partition count changed) keeps the newest record of the partition where it reached its
highest id.

A tombstone (null value) removes the key from the table. The state keeps it, one row per key
with the key's highest id, so that a late repeat of an older record cannot bring the key back in
a later micro-batch; the table a user reads is derived from that state after every fold.
"""

from __future__ import annotations

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

RECORD_COLUMNS = ("topic", "partition", "offset", "timestamp", "key", "value", "headers", "outbox_id", "create_time")
SCHEMA = ("topic string, partition int, offset long, timestamp timestamp, key string, value string, "
          "headers array<struct<key:string,value:string>>, outbox_id long, create_time timestamp, max_id long")
KEY = ("topic", "partition", "key")


def _same_key(left: DataFrame, right: DataFrame) -> list:
    return [left["topic"] == right["topic"], left["partition"] == right["partition"],
            left["key"].eqNullSafe(right["key"])]


def fold(previous: DataFrame | None, previous_keys: DataFrame | None, batch: DataFrame,
         batch_keys: DataFrame) -> DataFrame:
    """The latest-state rows (one per topic, partition and key, tombstones included) after `batch`.

    `batch` is the batch's normalized messages; `batch_keys` its per-key summary from
    `audit.fold` (`max_id`, `max_id_offset`: that id's first offset, `last_plain_offset`: the last
    message without an id); `previous`/`previous_keys` the latest state and the keys' highest ids
    before it (None: nothing before).
    """
    summary = batch_keys.alias("b")
    if previous_keys is not None:
        prior = previous_keys.select(*KEY, F.col("max_id").alias("prior_max")).alias("p")
        summary = summary.join(prior, _same_key(summary, prior), "left").select("b.*", "p.prior_max")
    else:
        summary = summary.withColumn("prior_max", F.lit(None).cast("long"))
    newer_id = F.col("max_id").isNotNull() & (F.col("prior_max").isNull() | (F.col("max_id") > F.col("prior_max")))
    plain_after = F.coalesce(F.col("last_plain_offset") > F.col("max_id_offset"), F.lit(False))
    chosen = summary.select(
        *KEY,
        F.when(newer_id, F.when(plain_after, F.col("last_plain_offset")).otherwise(F.col("max_id_offset")))
        .otherwise(F.col("last_plain_offset")).alias("offset"),
        F.greatest("max_id", "prior_max").alias("max_id"),
    ).where(F.col("offset").isNotNull())
    records = (batch.select(*RECORD_COLUMNS)
               .join(chosen.select("topic", "partition", "offset", "max_id"), ["topic", "partition", "offset"])
               .select(*RECORD_COLUMNS, "max_id"))
    if previous is None:
        return records
    before, replaced = previous.alias("l"), chosen.alias("c")
    return before.join(replaced, _same_key(before, replaced), "left_anti").unionByName(records)


def table(state: DataFrame) -> DataFrame:
    """What a user reads: per (topic, key) the newest record, tombstoned keys left out."""
    newest = Window.partitionBy("topic", "key").orderBy(F.col("max_id").desc_nulls_last(), F.col("partition").desc())
    return (state.withColumn("_n", F.row_number().over(newest)).where((F.col("_n") == 1) & F.col("value").isNotNull())
            .select(*RECORD_COLUMNS))


def write(state: DataFrame, path: str) -> None:
    """Replace `path` with the table of `state`, as Parquet partitioned by topic, rows by (partition, offset)."""
    (table(state).repartition("topic").sortWithinPartitions("topic", "partition", "offset")
     .write.mode("overwrite").partitionBy("topic").parquet(path))
