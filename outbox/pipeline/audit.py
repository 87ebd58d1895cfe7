"""The audit's checks, as pure functions over Spark DataFrames.

A batch audit and a follow-mode micro-batch run the same code: `fold(state, batch)` folds one
batch of messages into the audit's state (`AuditState`, a few small DataFrames), and
`summarize(state)` turns state into plain Python figures. A batch audit is one fold into empty
state, so the follow mode cannot drift from it.

What is checked, per topic:
- `without_headers`: messages lacking a usable `outbox-id` or `outbox-create-time` header;
- `distinct_ids` / `duplicates`: an id is identified by (topic, outbox id); every message of an id
  after its first is a duplicate (allowed: delivery is at least once);
- `reversals`: per (topic, partition, key) in offset order, a message whose id is lower than the
  highest id seen before it for that key (R0 R1 R1 R2 is fine, R0 R1 R2 R0 is one reversal);
- latency: the Kafka message timestamp minus `outbox-create-time`, kept as a histogram of whole
  milliseconds so that percentiles are exact to the millisecond and state stays small.

The ids seen are kept as Spark bitmaps (`bitmap_construct_agg`: one 4 KiB bitmap per 32,768
consecutive ids). Outbox ids come from one sequence, so they are dense: five million ids fit in
~150 bitmaps, counting distinct ids needs no shuffle of the ids, merging batches is an OR, and
ids missing from a ledger are a bitmap difference. Exact, like the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

ID_HEADER = "outbox-id"
CREATE_TIME_HEADER = "outbox-create-time"
PERCENTILES = (0.5, 0.95, 0.99)
EXAMPLE_KINDS = ("duplicates", "reversals", "without_headers")

COUNTERS_SCHEMA = ("topic string, messages long, with_id long, without_headers long, reversals long, "
                   "key_repeats long")
COUNTER_NAMES = ("messages", "with_id", "without_headers", "reversals", "key_repeats")
IDS_SCHEMA = "topic string, bucket long, bitmap binary"
KEYS_SCHEMA = "topic string, partition int, key string, max_id long, max_id_offset long"
LATENCY_SCHEMA = "topic string, latency_ms long, messages long"
EXAMPLES_SCHEMA = ("kind string, batch long, topic string, partition int, offset long, key string, outbox_id long, "
                   "previous_id long, first_partition int, first_offset long, detail string")
EXAMPLE_COLUMNS = [part.split()[0] for part in EXAMPLES_SCHEMA.split(", ")]


def _header(name: str) -> Column:
    """The last value of header `name` as text, or null when the message has no such header."""
    matching = F.filter(F.col("headers"), lambda header: header["key"] == F.lit(name))
    return F.try_element_at(matching, F.lit(-1))["value"].cast("string")


def _harvester_headers() -> tuple[Column, Column]:
    """`outbox-id` and `outbox-create-time` as text: fast where the harvester put them, else searched.

    The harvester appends the two after the record's own headers, so they are nearly always the
    last two; reading those by position costs a fraction of scanning the array with a lambda
    (which Spark evaluates without code generation), and the search remains for anything else.
    """
    last, second_last = F.try_element_at("headers", F.lit(-1)), F.try_element_at("headers", F.lit(-2))
    time_last = last["key"] == F.lit(CREATE_TIME_HEADER)
    id_second_last = time_last & (second_last["key"] == F.lit(ID_HEADER))
    id_text = F.when(id_second_last, second_last["value"].cast("string")).otherwise(_header(ID_HEADER))
    time_text = F.when(time_last, last["value"].cast("string")).otherwise(_header(CREATE_TIME_HEADER))
    return id_text, time_text


def normalize(raw: DataFrame) -> DataFrame:
    """Kafka source rows (binary key/value, headers) to typed rows the checks work on.

    Never drops a row: a message whose headers are missing or unparsable keeps a null
    `outbox_id` / `create_time` and a `problem` saying what is wrong, so it is counted.
    """
    id_text, time_text = _harvester_headers()
    outbox_id = F.trim(id_text).try_cast("bigint")
    create_time = F.trim(time_text).try_cast("timestamp")
    problem = (
        F.when(id_text.isNull(), F.lit(f"no {ID_HEADER} header"))
        .when(outbox_id.isNull(), F.concat(F.lit(f"{ID_HEADER} is not an integer: "), id_text))
        .when(time_text.isNull(), F.lit(f"no {CREATE_TIME_HEADER} header"))
        .when(create_time.isNull(), F.concat(F.lit(f"{CREATE_TIME_HEADER} is not a timestamp: "), time_text))
    )
    headers = F.transform(F.col("headers"), lambda h: F.struct(h["key"].alias("key"),
                                                               h["value"].cast("string").alias("value")))
    return raw.select(
        F.col("topic"),
        F.col("partition"),
        F.col("offset"),
        F.col("timestamp"),
        F.col("key").cast("string").alias("key"),
        F.col("value").cast("string").alias("value"),
        headers.alias("headers"),
        outbox_id.alias("outbox_id"),
        create_time.alias("create_time"),
        problem.alias("problem"),
    ).withColumn(
        "latency_ms",
        F.round((F.unix_micros("timestamp") - F.unix_micros("create_time")) / F.lit(1000.0)).cast("bigint"),
    )


@dataclass
class AuditState:
    """What the audit knows after some batches: small DataFrames, each keyed as its schema says.

    `counters` (per topic), `ids` (per topic and bucket: a bitmap of the ids seen), `keys` (per
    topic, partition and key: the highest id so far and the offset it first had), `latency`
    (histogram per topic), `examples` (capped). `messages` is the last batch's messages, kept
    for the rare look-up that needs them (examples of duplicates under different keys) and only
    while `cached` (persisted frames) is not released.
    """

    counters: DataFrame
    ids: DataFrame
    keys: DataFrame
    latency: DataFrame
    examples: DataFrame
    messages: DataFrame | None = None
    cached: list[DataFrame] = field(default_factory=list)

    TABLES = ("counters", "ids", "keys", "latency", "examples")
    SCHEMAS = {"counters": COUNTERS_SCHEMA, "ids": IDS_SCHEMA, "keys": KEYS_SCHEMA, "latency": LATENCY_SCHEMA,
               "examples": EXAMPLES_SCHEMA}

    def tables(self) -> dict[str, DataFrame]:
        return {name: getattr(self, name) for name in self.TABLES}

    def release(self) -> None:
        for frame in self.cached:
            frame.unpersist()
        self.cached.clear()
        self.messages = None


def empty_state(spark: SparkSession) -> AuditState:
    return AuditState(**{name: spark.createDataFrame([], schema) for name, schema in AuditState.SCHEMAS.items()})


def _flag(condition: Column) -> Column:
    return F.when(condition, F.lit(1)).otherwise(F.lit(0))


def id_bitmaps(frame: DataFrame, *group: str) -> DataFrame:
    """Bitmaps of the non-null `outbox_id`s of `frame`, per `group` columns and bucket."""
    ids = frame.where(F.col("outbox_id").isNotNull())
    return ids.groupBy(*group, F.bitmap_bucket_number("outbox_id").alias("bucket")).agg(
        F.bitmap_construct_agg(F.bitmap_bit_position("outbox_id")).alias("bitmap"))


def _merge_bitmaps(frame: DataFrame, *group: str) -> DataFrame:
    return frame.groupBy(*group, "bucket").agg(F.bitmap_or_agg("bitmap").alias("bitmap"))


def _bitmap_total() -> Column:
    """How many ids the `bitmap` column's rows hold, as an aggregate."""
    return F.coalesce(F.sum(F.bitmap_count("bitmap")), F.lit(0)).cast("bigint")


def _in_bitmap(outbox_id: Column, bitmap: Column) -> Column:
    """Whether `bitmap` (of the id's bucket) has `outbox_id`: bit position % 8 of byte position / 8."""
    position = F.bitmap_bit_position(outbox_id)
    byte = bitmap.substr((position / 8).cast("int") + 1, F.lit(1))
    value = F.conv(F.hex(byte), 16, 10).cast("int")
    mask = F.pow(F.lit(2), position % 8).cast("int")
    return F.coalesce(value.bitwiseAND(mask) != 0, F.lit(False))


def mark_reversals(batch: DataFrame, keys: DataFrame | None = None) -> DataFrame:
    """Adds `previous_id` (highest id before this message for its key), `previous_offset` (where
    that id first was), `reversal` (id below it) and `key_repeat` (id equal to it: a repeat).

    "Before" is offset order within the message's partition, starting from `keys` (the highest
    ids of earlier batches) when given. Messages without an id carry them along but never count.
    """
    before = Window.partitionBy("topic", "partition", "key").orderBy("offset").rowsBetween(
        Window.unboundedPreceding, -1)
    # The highest id and, among its messages, the lowest offset: max of (id, -offset).
    previous = F.max(F.when(F.col("outbox_id").isNotNull(),
                            F.struct(F.col("outbox_id").alias("id"), (-F.col("offset")).alias("neg_offset"))))
    marked = batch.withColumn("_previous", previous.over(before))
    if keys is not None:
        earlier = keys.select("topic", "partition", "key",
                              F.struct(F.col("max_id").alias("id"),
                                       (-F.col("max_id_offset")).alias("neg_offset")).alias("_earlier"))
        marked = (marked.join(earlier, ["topic", "partition", "key"], "left")
                  .withColumn("_previous", F.greatest("_previous", "_earlier")).drop("_earlier"))
    return (marked.withColumn("previous_id", F.col("_previous.id"))
            .withColumn("previous_offset", -F.col("_previous.neg_offset")).drop("_previous")
            .withColumn("reversal", F.coalesce(F.col("outbox_id") < F.col("previous_id"), F.lit(False)))
            .withColumn("key_repeat", F.coalesce(F.col("outbox_id") == F.col("previous_id"), F.lit(False))))


def _example(frame: DataFrame, kind: str, batch_id: int, **columns: Column) -> DataFrame:
    """Rows of `frame` in the examples' shape; columns not given are null."""
    defaults: dict[str, Column] = {
        "kind": F.lit(kind), "batch": F.lit(batch_id).cast("bigint"), "topic": F.col("topic"),
        "partition": F.col("partition"), "offset": F.col("offset"), "key": F.col("key"),
        "outbox_id": F.col("outbox_id"),
    }
    types = dict(part.split() for part in EXAMPLES_SCHEMA.split(", "))
    selected = [columns.get(name, defaults.get(name, F.lit(None))).cast(types[name]).alias(name)
                for name in EXAMPLE_COLUMNS]
    return frame.select(*selected)


def _first(frame: DataFrame, limit: int) -> DataFrame:
    return frame.orderBy("topic", "partition", "offset").limit(limit)


def _keep_examples(frame: DataFrame, limit: int) -> DataFrame:
    keep = Window.partitionBy("kind").orderBy("batch", "topic", "partition", "offset")
    return frame.withColumn("_n", F.row_number().over(keep)).where(F.col("_n") <= limit).drop("_n")


def fold(state: AuditState | None, batch: DataFrame, *, batch_id: int = 0, examples: int = 10) -> AuditState:
    """The state after `batch` (normalized messages) on top of `state` (None: nothing seen yet).

    The batch is scanned once (Kafka read, one shuffle for the per-key order) into a persisted
    frame, listed in the result's `cached`; every other frame of the result is derived from it
    and from `state`, lazily.
    """
    marked = mark_reversals(batch.select("topic", "partition", "offset", "key", "outbox_id", "latency_ms",
                                         "problem"),
                            state.keys if state is not None else None).persist()
    counters = marked.groupBy("topic").agg(
        F.count(F.lit(1)).alias("messages"),
        F.count("outbox_id").alias("with_id"),
        F.sum(_flag(F.col("problem").isNotNull())).cast("bigint").alias("without_headers"),
        F.sum(_flag(F.col("reversal"))).cast("bigint").alias("reversals"),
        F.sum(_flag(F.col("key_repeat"))).cast("bigint").alias("key_repeats"),
    )
    ids = id_bitmaps(marked, "topic")
    with_id = marked.where(F.col("outbox_id").isNotNull())
    highest = F.max(F.struct(F.col("outbox_id").alias("id"), (-F.col("offset")).alias("neg_offset")))
    keys = with_id.groupBy("topic", "partition", "key").agg(highest.alias("_max"))
    latency = marked.where(F.col("latency_ms").isNotNull()).groupBy("topic", "latency_ms").agg(
        F.count(F.lit(1)).alias("messages"))
    if state is not None:
        counters = counters.unionByName(state.counters).groupBy("topic").agg(
            *(F.sum(name).cast("bigint").alias(name) for name in COUNTER_NAMES))
        ids = _merge_bitmaps(ids.unionByName(state.ids), "topic")
        earlier_keys = state.keys.select("topic", "partition", "key", F.struct(
            F.col("max_id").alias("id"), (-F.col("max_id_offset")).alias("neg_offset")).alias("_max"))
        keys = keys.unionByName(earlier_keys).groupBy("topic", "partition", "key").agg(F.max("_max").alias("_max"))
        latency = latency.unionByName(state.latency).groupBy("topic", "latency_ms").agg(
            F.sum("messages").alias("messages"))
    keys = keys.select("topic", "partition", "key", F.col("_max.id").alias("max_id"),
                       (-F.col("_max.neg_offset")).alias("max_id_offset"))
    counters = counters.select("topic", *(F.col(name).cast("bigint").alias(name) for name in COUNTER_NAMES))
    latency = latency.withColumn("messages", F.col("messages").cast("bigint"))

    found = _first(_example(marked.where("reversal"), "reversals", batch_id, previous_id=F.col("previous_id")),
                   examples).unionByName(
        _first(_example(marked.where(F.col("problem").isNotNull()), "without_headers", batch_id,
                        detail=F.col("problem")), examples)).unionByName(
        _first(_example(marked.where("key_repeat"), "duplicates", batch_id, first_partition=F.col("partition"),
                        first_offset=F.col("previous_offset")), examples))
    if state is not None:
        found = state.examples.unionByName(found)
    return AuditState(counters=counters, ids=ids, keys=keys, latency=latency,
                      examples=_keep_examples(found, examples), messages=marked, cached=[marked])


def other_duplicates(messages: DataFrame, limit: int, batch_id: int = 0) -> DataFrame:
    """Examples of repeats that are not a key's latest id again (the id under another key or
    partition, or repeated after a higher one): the first `limit` ids with more than one message,
    each message after the id's first (lowest partition, then offset). Costs a pass over the ids.
    """
    with_id = messages.where(F.col("outbox_id").isNotNull() & ~F.col("key_repeat"))
    repeated = (messages.where(F.col("outbox_id").isNotNull())
                .groupBy("topic", "outbox_id").agg(F.count(F.lit(1)).alias("n"),
                                                   F.sum(_flag(F.col("key_repeat"))).alias("key_repeats"),
                                                   F.min(F.struct("partition", "offset")).alias("first"))
                .where(F.col("n") - F.col("key_repeats") > 1).orderBy("topic", "outbox_id").limit(limit)
                .select("topic", "outbox_id", F.col("first.partition").alias("first_partition"),
                        F.col("first.offset").alias("first_offset")))
    repeats = (with_id.join(F.broadcast(repeated), ["topic", "outbox_id"])
               .where((F.col("partition") != F.col("first_partition")) | (F.col("offset") != F.col("first_offset"))))
    return _first(_example(repeats, "duplicates", batch_id, first_partition=F.col("first_partition"),
                           first_offset=F.col("first_offset")), limit)


def first_occurrences(batch: DataFrame) -> DataFrame:
    """The de-duplicated records: per (topic, outbox id) the message at the lowest (partition, offset).

    Messages without a usable outbox id are left out (they are counted as `without_headers`).
    """
    first = Window.partitionBy("topic", "outbox_id").orderBy("partition", "offset")
    return (batch.where(F.col("outbox_id").isNotNull())
            .withColumn("_n", F.row_number().over(first)).where(F.col("_n") == 1)
            .select("topic", "partition", "offset", "timestamp", "key", "value", "headers", "outbox_id",
                    "create_time"))


@dataclass
class Findings:
    """`summarize()`'s answer: plain Python, ready for report.py."""

    topics: dict[str, dict[str, Any]]
    latency_ms: dict[str, float | None]
    examples: dict[str, list[dict[str, Any]]]
    missing: int = 0
    missing_examples: list[int] = field(default_factory=list)
    ledger_ids: int | None = None


def _percentiles(values: list[float] | None) -> dict[str, float | None]:
    names = [f"p{round(p * 100)}" for p in PERCENTILES]
    if not values:
        return dict.fromkeys(names)
    return {name: round(float(value), 3) for name, value in zip(names, values, strict=True)}


def summarize(state: AuditState, *, ledger: DataFrame | None = None, examples: int = 10,
              progress: Callable[[str], None] | None = None) -> Findings:
    """Collect the figures: per topic, latency percentiles, examples, and ids of `ledger` not seen.

    `ledger` is a frame with one column `outbox_id` (ids expected in the topics, any topic).
    `progress` hears of each step (the first one reads the messages when the state is fresh).
    """
    say = progress or (lambda _message: None)
    topics: dict[str, dict[str, Any]] = {}
    say("counting messages, headers and reversals")
    key_repeats = 0
    for row in state.counters.collect():
        topics[row["topic"]] = {"messages": row["messages"], "without_headers": row["without_headers"],
                                "reversals": row["reversals"], "distinct_ids": 0, "duplicates": row["with_id"],
                                "latency_ms": _percentiles(None)}
        key_repeats += row["key_repeats"]
    say("counting distinct ids and duplicates")
    for row in state.ids.groupBy("topic").agg(_bitmap_total().alias("distinct")).collect():
        detail = topics.setdefault(row["topic"], {"duplicates": 0})
        detail["distinct_ids"] = row["distinct"]
        detail["duplicates"] = detail["duplicates"] - row["distinct"]
    say("latency percentiles")
    wanted = F.array(*(F.lit(p) for p in PERCENTILES))
    percentile = F.percentile(F.col("latency_ms"), wanted, F.col("messages")).alias("p")
    for row in state.latency.groupBy("topic").agg(percentile).collect():
        topics.setdefault(row["topic"], {})["latency_ms"] = _percentiles(row["p"])
    overall = state.latency.agg(percentile).collect()[0]["p"]

    say("collecting examples")
    found: dict[str, list[dict[str, Any]]] = {kind: [] for kind in EXAMPLE_KINDS}
    for row in state.examples.orderBy("kind", "batch", "topic", "partition", "offset").collect():
        found[row["kind"]].append(_example_dict(row))
    duplicates = sum(detail.get("duplicates", 0) for detail in topics.values())
    if duplicates > key_repeats and len(found["duplicates"]) < examples and state.messages is not None:
        say("looking for examples of the other duplicates")
        extra = other_duplicates(state.messages, examples - len(found["duplicates"])).collect()
        found["duplicates"].extend(_example_dict(row) for row in extra)

    findings = Findings(topics=topics, latency_ms=_percentiles(overall), examples=found)
    if ledger is not None:
        say("comparing with the ledger")
        findings.ledger_ids, findings.missing, findings.missing_examples = _missing(state.ids, ledger, examples)
    return findings


def _missing(ids: DataFrame, ledger: DataFrame, examples: int) -> tuple[int, int, list[int]]:
    """(ledger's distinct ids, how many of them are in no topic, the lowest of those)."""
    seen = _merge_bitmaps(ids.select("bucket", "bitmap"))
    expected = id_bitmaps(ledger)
    union = _merge_bitmaps(seen.unionByName(expected))
    row = (expected.agg(_bitmap_total().alias("expected"))
           .crossJoin(seen.agg(_bitmap_total().alias("seen")))
           .crossJoin(union.agg(_bitmap_total().alias("union"))).collect()[0])
    missing = row["union"] - row["seen"]  # |expected - seen| = |expected | seen| - |seen|
    lowest: list[int] = []
    if missing:
        candidates = ledger.select("outbox_id").where(F.col("outbox_id").isNotNull()).distinct()
        candidates = candidates.withColumn("bucket", F.bitmap_bucket_number("outbox_id"))
        absent = (candidates.join(F.broadcast(seen), "bucket", "left")
                  .where(~_in_bitmap(F.col("outbox_id"), F.col("bitmap"))))
        lowest = [r["outbox_id"] for r in absent.orderBy("outbox_id").limit(examples).collect()]
    return row["expected"], missing, lowest


def _example_dict(row: Any) -> dict[str, Any]:
    """One example for the report: where the message is and the ids involved (nulls left out)."""
    item = {"topic": row["topic"], "partition": row["partition"], "offset": row["offset"], "key": row["key"],
            "outbox_id": row["outbox_id"]}
    if row["kind"] == "reversals":
        item["previous_max_id"] = row["previous_id"]
    elif row["kind"] == "duplicates":
        item["first_seen"] = {"partition": row["first_partition"], "offset": row["first_offset"]}
    elif row["kind"] == "without_headers":
        item["problem"] = row["detail"]
        if item["outbox_id"] is None:
            del item["outbox_id"]
    return item
