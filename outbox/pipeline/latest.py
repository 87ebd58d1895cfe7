"""`--latest DIR`: the newest record of every key, as a compacted topic would hold it, but queryable.

Which record is a key's newest follows the ordering rule of the audit itself: the one with the
highest outbox id, so that a late repeat of an older id (which at-least-once delivery allows)
never wins, and neither does a reversal. Messages without an `outbox-id` header fall back to
offset order: such a message is newer than everything before it in its partition and older than
the next message with a higher id than the key had. A key found in several partitions (a topic
whose partition count changed) keeps the newest record of the partition where it reached its
highest id.

A tombstone (null value) removes the key from the table, or, with `tombstones="mark"`, keeps the
tombstone as the key's row with `deleted` true. Either way a late repeat of an older record
cannot bring the key back in a later micro-batch: the audit's state keeps each key's highest id.

Two ways to keep the table in follow mode:
- Parquet: the state keeps every key's newest record (`fold`), and the table is rewritten from it
  after every micro-batch (`write`): the cost grows with the number of keys.
- Delta: the table itself is the state. Each micro-batch computes, from its own messages and the
  keys' highest ids, the keys whose newest record it changed (`changes`), and MERGEs only those
  (`merge`): the cost grows with the micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from outbox.pipeline import delta_table

RECORD_COLUMNS = ("topic", "partition", "offset", "timestamp", "key", "value", "headers", "outbox_id", "create_time")
SCHEMA = ("topic string, partition int, offset long, timestamp timestamp, key string, value string, "
          "headers array<struct<key:string,value:string>>, outbox_id long, create_time timestamp, max_id long")
KEY = ("topic", "partition", "key")


def _same_key(left: DataFrame, right: DataFrame) -> list:
    return [left["topic"] == right["topic"], left["partition"] == right["partition"],
            left["key"].eqNullSafe(right["key"])]


Tombstones = Literal["delete", "mark"]
TOMBSTONES = ("delete", "mark")
# Deletion vectors let a MERGE mark replaced rows instead of rewriting every file that holds one: the
# difference between a cost in proportion to the micro-batch and one in proportion to the table.
DELTA_PROPERTIES = {"delta.enableDeletionVectors": "true"}


def _chosen(previous_keys: DataFrame | None, batch_keys: DataFrame) -> DataFrame:
    """Per (topic, partition, key) of the batch whose newest record it changes: that record's `offset`, and
    `max_id`, the key's highest id in that partition after the batch (null: it never had one)."""
    summary = batch_keys.alias("b")
    if previous_keys is not None:
        prior = previous_keys.select(*KEY, F.col("max_id").alias("prior_max")).alias("p")
        summary = summary.join(prior, _same_key(summary, prior), "left").select("b.*", "p.prior_max")
    else:
        summary = summary.withColumn("prior_max", F.lit(None).cast("long"))
    newer_id = F.col("max_id").isNotNull() & (F.col("prior_max").isNull() | (F.col("max_id") > F.col("prior_max")))
    plain_after = F.coalesce(F.col("last_plain_offset") > F.col("max_id_offset"), F.lit(False))
    return summary.select(
        *KEY,
        F.when(newer_id, F.when(plain_after, F.col("last_plain_offset")).otherwise(F.col("max_id_offset")))
        .otherwise(F.col("last_plain_offset")).alias("offset"),
        F.greatest("max_id", "prior_max").alias("max_id"),
    ).where(F.col("offset").isNotNull())


def _records(batch: DataFrame, chosen: DataFrame) -> DataFrame:
    """The chosen messages of `batch` with their partition's `max_id`."""
    return (batch.select(*RECORD_COLUMNS)
            .join(chosen.select("topic", "partition", "offset", "max_id"), ["topic", "partition", "offset"])
            .select(*RECORD_COLUMNS, "max_id"))


def fold(previous: DataFrame | None, previous_keys: DataFrame | None, batch: DataFrame,
         batch_keys: DataFrame) -> DataFrame:
    """The latest-state rows (one per topic, partition and key, tombstones included) after `batch`.

    `batch` is the batch's normalized messages; `batch_keys` its per-key summary from
    `audit.fold` (`max_id`, `max_id_offset`: that id's first offset, `last_plain_offset`: the last
    message without an id); `previous`/`previous_keys` the latest state and the keys' highest ids
    before it (None: nothing before).
    """
    chosen = _chosen(previous_keys, batch_keys)
    records = _records(batch, chosen)
    if previous is None:
        return records
    before, replaced = previous.alias("l"), chosen.alias("c")
    return before.join(replaced, _same_key(before, replaced), "left_anti").unionByName(records)


def _newest(rows: DataFrame) -> Column:
    """Row number 1 for each (topic, key)'s newest row: of the partition where the key reached its highest id."""
    order = Window.partitionBy("topic", "key").orderBy(F.col("max_id").desc_nulls_last(), F.col("partition").desc())
    return F.row_number().over(order)


def table(state: DataFrame, tombstones: Tombstones = "delete") -> DataFrame:
    """What a user reads: per (topic, key) the newest record; tombstoned keys left out, or marked `deleted`."""
    newest = state.withColumn("_n", _newest(state)).where(F.col("_n") == 1)
    if tombstones == "mark":
        return newest.select(*RECORD_COLUMNS, F.col("value").isNull().alias("deleted"))
    return newest.where(F.col("value").isNotNull()).select(*RECORD_COLUMNS)


# Up to this many keys in a micro-batch, the frames of its keys are broadcast to the joins with larger ones (the
# keys' state, the table) instead of shuffling both sides: Spark cannot size a checkpointed frame by itself.
BROADCAST_KEYS = 100_000
# And a frame of whole records (the MERGE's source) only while its values add up to at most this: a broadcast
# goes through the driver, and a micro-batch of big payloads would fail there, again at every restart.
BROADCAST_BYTES = 64 * 2**20


def _broadcast_if_few(materialized: DataFrame, *, values: bool = False) -> Callable[[DataFrame], DataFrame]:
    """A broadcast hint for frames of the size of `materialized` (a local checkpoint: counting it is cheap) when it
    holds at most BROADCAST_KEYS rows (and, with `values`, at most BROADCAST_BYTES of them), else no hint."""
    if values:
        rows, size = materialized.agg(F.count(F.lit(1)), F.sum(F.length("value"))).first()
        few = rows <= BROADCAST_KEYS and (size or 0) <= BROADCAST_BYTES
    else:
        few = materialized.count() <= BROADCAST_KEYS
    return F.broadcast if few else (lambda frame: frame)


def changes(previous_keys: DataFrame, batch: DataFrame, batch_keys: DataFrame) -> DataFrame:
    """The rows a micro-batch changes in the table: per (topic, key), its new newest record (a null `value`:
    a tombstone), with `_by_id`, whether the key ever had an outbox id. Materialized (a local checkpoint).

    A record from one partition is the key's newest only when that partition holds the key's highest
    id of all its partitions after the batch (ties: the higher partition), which the keys' highest
    ids tell without reading the table. A key that never had an id in any partition is decided
    against the table's row in `merge` (the higher partition wins).

    `previous_keys` (one row per key ever seen) is read once, for the batch's keys only: those are
    few and materialized, so Spark broadcasts them instead of shuffling every key of the table, and
    so are the frames derived from them (up to BROADCAST_KEYS keys).
    """
    touched = batch_keys.select("topic", "key").distinct().localCheckpoint().alias("t")
    known = previous_keys.alias("k")
    prior = (known.join(touched, [known["topic"] == touched["topic"], known["key"].eqNullSafe(touched["key"])])
             .select(known["topic"], known["partition"], known["key"], known["max_id"]).localCheckpoint())
    few = _broadcast_if_few(touched)
    records = _records(batch, _chosen(few(prior), batch_keys))
    candidates = records.withColumn("_n", _newest(records)).where(F.col("_n") == 1).drop("_n").alias("c")
    after = (prior.unionByName(batch_keys.where(F.col("max_id").isNotNull()).select(*KEY, "max_id"))
             .groupBy(F.col("topic").alias("_topic"), F.col("key").alias("_key"))
             .agg(F.max(F.struct("max_id", "partition")).alias("_top")).alias("r"))
    joined = candidates.join(few(after), [candidates["topic"] == after["_topic"],
                                          candidates["key"].eqNullSafe(after["_key"])], "left")
    best = F.col("_top")
    wins = ((best.isNull() & F.col("max_id").isNull())
            | ((F.col("max_id") == best.getField("max_id")) & (F.col("partition") == best.getField("partition"))))
    return joined.where(wins).select(*RECORD_COLUMNS, F.col("max_id").isNotNull().alias("_by_id")).localCheckpoint()


def merge(spark: SparkSession, path: str, changed: DataFrame, commit: delta_table.Commit,
          tombstones: Tombstones = "delete") -> None:
    """MERGE `changes()` (materialized) into the Delta table at `path`, in one commit (skipped if `commit`
    is there already)."""
    # Spark cannot size a checkpointed RDD: without the hint the MERGE's search for the files it touches
    # shuffles every row of the table to join them with the source.
    source = _broadcast_if_few(changed, values=True)(changed).alias("s")
    target = delta_table.table(spark, path).alias("t")
    same_key = (F.col("t.topic") == F.col("s.topic")) & F.col("t.key").eqNullSafe(F.col("s.key"))
    newer = F.col("s._by_id") | (F.col("s.partition") >= F.col("t.partition"))
    values: dict[str, str | Column] = {name: F.col(f"s.{name}") for name in RECORD_COLUMNS}
    tombstone = F.col("s.value").isNull()
    builder = target.merge(source, same_key)
    if tombstones == "mark":
        values["deleted"] = tombstone
        builder = builder.whenMatchedUpdate(newer, values).whenNotMatchedInsert(values=values)
    else:
        builder = (builder.whenMatchedDelete(newer & tombstone).whenMatchedUpdate(newer, values)
                   .whenNotMatchedInsert(~tombstone, values))
    with delta_table.transaction(spark, commit, materialized_source=True):
        builder.execute()


def write(state: DataFrame, path: str, *, table_format: str = "parquet", tombstones: Tombstones = "delete",
          commit: delta_table.Commit | None = None) -> None:
    """Replace `path` with the table of `state`, partitioned by topic, rows by (partition, offset).

    As Parquet the folder is replaced file by file; as Delta in one commit (`commit`).
    """
    # A file per (topic, Kafka partition): a MERGE scans the table's keys in as many tasks, not in one.
    rows = (table(state, tombstones).repartition("topic", "partition")
            .sortWithinPartitions("topic", "partition", "offset"))
    if table_format == delta_table.FORMAT:
        delta_table.write(rows, path, commit or delta_table.Commit(), overwrite=True, properties=DELTA_PROPERTIES)
    else:
        rows.write.mode("overwrite").partitionBy("topic").parquet(path)
