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

COUNTERS_SCHEMA = "topic string, messages long, without_headers long, reversals long"
IDS_SCHEMA = "topic string, outbox_id long, occurrences long, first_partition int, first_offset long, key string"
KEYS_SCHEMA = "topic string, partition int, key string, max_id long"
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

    `counters` (per topic), `ids` (per topic and id: occurrences and first place), `keys` (per topic,
    partition and key: highest id so far), `latency` (histogram per topic), `examples` (capped).
    `cached` holds DataFrames persisted while folding; `release()` frees them.
    """

    counters: DataFrame
    ids: DataFrame
    keys: DataFrame
    latency: DataFrame
    examples: DataFrame
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


def empty_state(spark: SparkSession) -> AuditState:
    return AuditState(**{name: spark.createDataFrame([], schema) for name, schema in AuditState.SCHEMAS.items()})


def _flag(condition: Column) -> Column:
    return F.when(condition, F.lit(1)).otherwise(F.lit(0))


def mark_reversals(batch: DataFrame, keys: DataFrame | None = None) -> DataFrame:
    """Adds `previous_id` (highest id before this message for its key) and `reversal`.

    "Before" is offset order within the message's partition, starting from `keys` (the highest
    ids of earlier batches) when given. Messages without an id carry them along but never count.
    """
    before = Window.partitionBy("topic", "partition", "key").orderBy("offset").rowsBetween(
        Window.unboundedPreceding, -1)
    marked = batch.withColumn("previous_id", F.max("outbox_id").over(before))
    if keys is not None:
        earlier = keys.select("topic", "partition", "key", F.col("max_id").alias("_earlier_max"))
        marked = (marked.join(earlier, ["topic", "partition", "key"], "left")
                  .withColumn("previous_id", F.greatest("previous_id", "_earlier_max")).drop("_earlier_max"))
    return marked.withColumn("reversal", F.coalesce(F.col("outbox_id") < F.col("previous_id"), F.lit(False)))


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


def fold(state: AuditState | None, batch: DataFrame, *, batch_id: int = 0, examples: int = 10) -> AuditState:
    """The state after `batch` (normalized messages) on top of `state` (None: nothing seen yet).

    The batch is scanned once into a persisted frame (listed in the result's `cached`); every
    other frame of the result is derived from it and from `state`, lazily.
    """
    marked = mark_reversals(batch.select("topic", "partition", "offset", "key", "outbox_id", "latency_ms",
                                         "problem"),
                            state.keys if state is not None else None)
    marked = marked.persist()
    with_id = marked.where(F.col("outbox_id").isNotNull())

    counters = marked.groupBy("topic").agg(
        F.count(F.lit(1)).alias("messages"),
        F.sum(_flag(F.col("problem").isNotNull())).cast("bigint").alias("without_headers"),
        F.sum(_flag(F.col("reversal"))).cast("bigint").alias("reversals"),
    )
    first_place = F.min(F.struct("partition", "offset", "key"))
    batch_ids = with_id.groupBy("topic", "outbox_id").agg(F.count(F.lit(1)).alias("occurrences"),
                                                          first_place.alias("first")).persist()
    ids = batch_ids
    keys = with_id.groupBy("topic", "partition", "key").agg(F.max("outbox_id").alias("max_id"))
    latency = marked.where(F.col("latency_ms").isNotNull()).groupBy("topic", "latency_ms").agg(
        F.count(F.lit(1)).alias("messages"))
    earlier_ids = None
    if state is not None:
        counters = counters.unionByName(state.counters).groupBy("topic").agg(
            *(F.sum(name).cast("bigint").alias(name) for name in ("messages", "without_headers", "reversals")))
        earlier_ids = state.ids.select("topic", "outbox_id", "occurrences",
                                       F.struct(F.col("first_partition").alias("partition"),
                                                F.col("first_offset").alias("offset"), "key").alias("first"))
        ids = ids.unionByName(earlier_ids).groupBy("topic", "outbox_id").agg(
            F.sum("occurrences").alias("occurrences"), F.min("first").alias("first"))
        keys = keys.unionByName(state.keys).groupBy("topic", "partition", "key").agg(F.max("max_id").alias("max_id"))
        latency = latency.unionByName(state.latency).groupBy("topic", "latency_ms").agg(
            F.sum("messages").alias("messages"))
    ids = ids.select("topic", "outbox_id", F.col("occurrences").cast("bigint").alias("occurrences"),
                     F.col("first.partition").alias("first_partition"), F.col("first.offset").alias("first_offset"),
                     F.col("first.key").alias("key"))
    latency = latency.withColumn("messages", F.col("messages").cast("bigint"))

    found = [
        _first(_example(marked.where("reversal"), "reversals", batch_id, previous_id=F.col("previous_id")), examples),
        _first(_example(marked.where(F.col("problem").isNotNull()), "without_headers", batch_id,
                        detail=F.col("problem")), examples),
        _first(_duplicate_examples(with_id, batch_ids, earlier_ids, batch_id, examples), examples),
    ]
    new_examples = found[0].unionByName(found[1]).unionByName(found[2])
    if state is not None:
        new_examples = state.examples.unionByName(new_examples)
    keep = Window.partitionBy("kind").orderBy("batch", "topic", "partition", "offset")
    kept = new_examples.withColumn("_n", F.row_number().over(keep)).where(F.col("_n") <= examples).drop("_n")
    return AuditState(counters=counters, ids=ids, keys=keys, latency=latency, examples=kept,
                      cached=[marked, batch_ids])


def _duplicate_examples(with_id: DataFrame, batch_ids: DataFrame, earlier_ids: DataFrame | None, batch_id: int,
                        limit: int) -> DataFrame:
    """Messages of this batch that repeat an id first seen elsewhere (the first `limit` such ids).

    Works from this batch's id counts (and the earlier ids, in follow mode) so that finding a few
    examples never costs another pass over all ids.
    """
    if earlier_ids is None:
        repeated = batch_ids.where(F.col("occurrences") > 1)
    else:
        earlier = earlier_ids.select("topic", "outbox_id", F.col("first").alias("_earlier_first"))
        repeated = (batch_ids.join(earlier, ["topic", "outbox_id"], "left")
                    .where((F.col("occurrences") > 1) | F.col("_earlier_first").isNotNull())
                    .withColumn("first", F.least("first", "_earlier_first")))
    chosen = (repeated.orderBy("topic", "outbox_id").limit(limit)
              .select("topic", "outbox_id", F.col("first.partition").alias("first_partition"),
                      F.col("first.offset").alias("first_offset")))
    repeats = (with_id.join(F.broadcast(chosen), ["topic", "outbox_id"])
               .where((F.col("partition") != F.col("first_partition")) | (F.col("offset") != F.col("first_offset"))))
    return _example(repeats, "duplicates", batch_id, first_partition=F.col("first_partition"),
                    first_offset=F.col("first_offset"))


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
    for row in state.counters.collect():
        topics[row["topic"]] = {"messages": row["messages"], "without_headers": row["without_headers"],
                                "reversals": row["reversals"], "distinct_ids": 0, "duplicates": 0,
                                "latency_ms": _percentiles(None)}
    per_topic_ids = state.ids.groupBy("topic").agg(
        F.count(F.lit(1)).alias("distinct_ids"), F.sum(F.col("occurrences") - 1).alias("duplicates"))
    say("counting distinct ids and duplicates")
    for row in per_topic_ids.collect():
        topics.setdefault(row["topic"], {}).update(distinct_ids=row["distinct_ids"], duplicates=row["duplicates"])
    wanted = F.array(*(F.lit(p) for p in PERCENTILES))
    percentile = F.percentile(F.col("latency_ms"), wanted, F.col("messages")).alias("p")
    say("latency percentiles")
    for row in state.latency.groupBy("topic").agg(percentile).collect():
        topics.setdefault(row["topic"], {})["latency_ms"] = _percentiles(row["p"])
    overall = state.latency.agg(percentile).collect()[0]["p"]

    say("collecting examples")
    found: dict[str, list[dict[str, Any]]] = {kind: [] for kind in EXAMPLE_KINDS}
    for row in state.examples.orderBy("kind", "batch", "topic", "partition", "offset").collect():
        found[row["kind"]].append(_example_dict(row))

    findings = Findings(topics=topics, latency_ms=_percentiles(overall), examples=found)
    if ledger is not None:
        say("comparing with the ledger")
        expected = ledger.select("outbox_id").where(F.col("outbox_id").isNotNull()).distinct()
        absent = expected.join(state.ids.select("outbox_id"), "outbox_id", "left_anti").persist()
        try:
            findings.ledger_ids = expected.count()
            findings.missing = absent.count()
            findings.missing_examples = [row["outbox_id"] for row in
                                         absent.orderBy("outbox_id").limit(examples).collect()]
        finally:
            absent.unpersist()
    return findings


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
