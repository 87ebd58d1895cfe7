"""The audit's checks, as functions over Spark DataFrames.

A batch audit and a follow-mode micro-batch run the same code: `fold(state, batch)` folds one
batch of messages into the audit's state (`AuditState`, a few small DataFrames), and
`summarize(state)` turns state into plain Python figures. A batch audit is one fold into empty
state, so the follow mode cannot drift from it.

What is checked, per topic:
- `without_headers`: messages lacking a usable `outbox-id` or `outbox-create-time` header;
- `distinct_ids` / `duplicates`: an id is identified by (topic, outbox id); every message of an id
  after its first is a duplicate (allowed: delivery is at least once);
- `reversals`: per key (topic, partition, key) in offset order, a message whose id its key never
  had before and that is lower than an id the key already had. A repeat of an id already published
  is a duplicate, never a reversal: R0 R1 R2 R1 R2 R3 has none, R0 R2 R1 has one;
- latency: the Kafka message timestamp minus `outbox-create-time`, kept as a histogram of whole
  milliseconds so that percentiles are exact to the millisecond and state stays small.

How it runs (see docs/benchmarks.md for what each choice saved): the messages are read once and
shuffled once, narrow, by key; each key's messages are sorted by id (descending) after a 64-bit
hash of the key, so the sort compares longs. Over that order two range windows give, for every
message, the first offset of its id in the key (an earlier one means a repeat) and the earliest
message of a higher id (an earlier one means a reversal): no per-key set of ids is ever built.
Everything else (counters, latency histogram, the id words of ids.py, per-key summaries,
examples) comes out of one hash aggregation over the marked messages, and only that small result
is cached for the figures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from outbox.pipeline import ids as id_words
from outbox.pipeline import latest as latest_state

ID_HEADER = "outbox-id"
CREATE_TIME_HEADER = "outbox-create-time"
PERCENTILES = (0.5, 0.95, 0.99)
EXAMPLE_KINDS = ("duplicates", "reversals", "without_headers")
NARROW = ("topic", "partition", "offset", "key", "outbox_id", "latency_ms", "problem")

COUNTER_NAMES = ("messages", "with_id", "without_headers", "reversals", "key_repeats")
COUNTERS_SCHEMA = "topic string, " + ", ".join(f"{name} long" for name in COUNTER_NAMES)
IDS_SCHEMA = f"topic string, {id_words.SCHEMA}"
KEYS_SCHEMA = "topic string, partition int, key string, max_id long, max_id_offset long"
LATENCY_SCHEMA = "topic string, latency_ms long, messages long"
EXAMPLES_SCHEMA = ("kind string, batch long, topic string, partition int, offset long, key string, outbox_id long, "
                   "other_id long, other_partition int, other_offset long, detail string")
EXAMPLE_COLUMNS = [part.split()[0] for part in EXAMPLES_SCHEMA.split(", ")]

# Kinds of rows in the one aggregation (see _aggregate).
_COUNTS, _IDS, _KEYS, _REVERSAL, _REPEAT, _PROBLEM = range(6)
_EXAMPLE_KIND = {_REVERSAL: "reversals", _REPEAT: "duplicates", _PROBLEM: "without_headers"}
_FLAGS = ("messages", "with_id", "without_headers", "reversals", "key_repeats", "timed")
_VALUES = {"x1": F.max, "x2": F.min, "x3": F.max, "x4": F.max}  # per-kind meanings in _aggregate


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
    ).withColumn("latency_ms", _whole_ms(F.unix_micros("timestamp") - F.unix_micros("create_time")))


def _whole_ms(micros: Column) -> Column:
    """Microseconds to whole milliseconds, half away from zero, in integer arithmetic.

    The same as `round(micros / 1000.0)`, which Spark computes through BigDecimal: twice the cost.
    """
    return F.when(micros >= 0, F.floor((micros + 500) / 1000)).otherwise(-F.floor((-micros + 500) / 1000))


@dataclass
class AuditState:
    """What the audit knows after some batches: small DataFrames, each keyed as its schema says.

    `counters` (per topic), `ids` (per topic: the ids seen, as words), `keys` (per topic, partition
    and key: the highest id so far and the offset it first had), `latency` (histogram per topic),
    `examples` (capped) and, when kept, `latest` (latest.py: each key's newest record). `messages`
    is the last batch's messages (for the rare look-up of repeats under other keys), usable only
    while `cached` (persisted frames) is not released.
    """

    counters: DataFrame
    ids: DataFrame
    keys: DataFrame
    latency: DataFrame
    examples: DataFrame
    latest: DataFrame | None = None
    messages: DataFrame | None = None
    cached: list[DataFrame] = field(default_factory=list)

    TABLES = ("counters", "ids", "keys", "latency", "examples", "latest")
    SCHEMAS = {"counters": COUNTERS_SCHEMA, "ids": IDS_SCHEMA, "keys": KEYS_SCHEMA, "latency": LATENCY_SCHEMA,
               "examples": EXAMPLES_SCHEMA, "latest": latest_state.SCHEMA}

    def tables(self) -> dict[str, DataFrame]:
        """The tables kept (`latest` only when it is)."""
        return {name: getattr(self, name) for name in self.TABLES if getattr(self, name) is not None}

    def release(self) -> None:
        for frame in self.cached:
            frame.unpersist()
        self.cached.clear()
        self.messages = None


def empty_state(spark: SparkSession, *, latest: bool = False) -> AuditState:
    return AuditState(**{name: spark.createDataFrame([], schema) for name, schema in AuditState.SCHEMAS.items()
                         if latest or name != "latest"})


def _flag(condition: Column) -> Column:
    return F.when(condition, F.lit(1)).otherwise(F.lit(0))


def _join_on_key(left: DataFrame, right: DataFrame, *, prefix: str) -> DataFrame:
    """`left` with `right`'s other columns, matched on (topic, partition, key); a null key matches a null key."""
    renamed = right.select(*(F.col(name).alias(prefix + name) for name in right.columns))
    condition = [left["topic"] == renamed[prefix + "topic"], left["partition"] == renamed[prefix + "partition"],
                 left["key"].eqNullSafe(renamed[prefix + "key"])]
    joined = left.join(renamed, condition, "left")
    return joined.drop(*(prefix + name for name in ("topic", "partition", "key")))


def mark(messages: DataFrame, keys: DataFrame | None = None, ids: DataFrame | None = None) -> DataFrame:
    """Each message with what the per-key order says of it.

    Adds `repeat` (its id was published before for its key: a duplicate), `reversal` (a first
    occurrence lower than an id its key had before), `other_id`/`other_offset` (for a reversal, a
    higher id of its key published before it; for a repeat, where the id was first seen) and
    `is_top` (the first message of the key's highest id in this batch). "Before" is offset order
    within the key's partition, starting from `keys` (each key's highest id in earlier batches)
    when given; `ids` (the word set of earlier batches) then tells whether an id below that was
    published before. Messages without an id are carried along and never flagged.
    """
    by_key = messages.repartition("topic", "partition", "key").withColumn("_hash", F.xxhash64("key"))
    # Sorted by the key's hash first, so that the sort compares longs; then by id, highest first.
    by_id = Window.partitionBy("_hash", "topic", "partition", "key").orderBy(F.col("outbox_id").desc())
    has_id = F.col("outbox_id").isNotNull()
    marked = (by_key
              .withColumn("_first", F.min("offset").over(by_id.rangeBetween(0, 0)))
              .withColumn("_higher", F.min(F.struct("offset", "outbox_id")).over(
                  by_id.rangeBetween(Window.unboundedPreceding, -1)))
              .withColumn("_key_max", F.max("outbox_id").over(
                  by_id.rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing))))
    repeat_here = has_id & (F.col("offset") > F.col("_first"))
    higher_here = has_id & F.coalesce(F.col("_higher.offset") < F.col("offset"), F.lit(False))
    if keys is None:
        repeat, reversal_earlier, seen_before = repeat_here, F.lit(False), F.lit(False)
        prior_id, prior_offset = F.lit(None).cast("long"), F.lit(None).cast("long")
    else:
        marked = _join_on_key(marked, keys.select("topic", "partition", "key", "max_id", "max_id_offset"),
                              prefix="_prior_")
        prior_id, prior_offset = F.col("_prior_max_id"), F.col("_prior_max_id_offset")
        below_prior = has_id & F.coalesce(F.col("outbox_id") < prior_id, F.lit(False))
        seen_before = F.lit(False)
        if ids is not None:  # only ids below the key's earlier highest need the look-up
            lookup = ids.select(F.col("topic").alias("_seen_topic"), F.col("word").alias("_seen_word"),
                                F.col("bits").alias("_seen_bits"))
            needs = below_prior & ~repeat_here
            marked = marked.join(lookup, (F.col("topic") == F.col("_seen_topic"))
                                 & (id_words.word_of(F.col("outbox_id")) == F.col("_seen_word")) & needs, "left")
            seen_before = id_words.contains(F.col("_seen_bits"), F.col("outbox_id"))
        repeat = repeat_here | (has_id & F.coalesce(F.col("outbox_id") == prior_id, F.lit(False))) | (
            below_prior & seen_before)
        reversal_earlier = below_prior
    reversal = has_id & ~repeat & (higher_here | reversal_earlier)
    earlier = F.coalesce(F.col("outbox_id") < prior_id, F.lit(False))
    other_id = (F.when(reversal & earlier, prior_id).when(reversal, F.col("_higher.outbox_id"))
                .when(repeat, F.col("outbox_id")))
    other_offset = (F.when(reversal & earlier, prior_offset).when(reversal, F.col("_higher.offset"))
                    .when(repeat_here, F.col("_first"))
                    .when(repeat & (F.col("outbox_id") == prior_id), prior_offset))
    is_top = has_id & (F.col("outbox_id") == F.col("_key_max")) & (F.col("offset") == F.col("_first"))
    return marked.select(*NARROW, repeat.alias("repeat"), reversal.alias("reversal"), other_id.alias("other_id"),
                         other_offset.alias("other_offset"), is_top.alias("is_top"))


def _row(kind: int, condition: Column, *, partition: Column | None = None, a: Column | None = None,
         key: Column | None = None, detail: Column | None = None, flags: dict[str, Column] | None = None,
         bits: Column | None = None, **values: Column) -> Column:
    """One element of the rows each message contributes to the aggregation (null: none of this kind)."""
    long_null = F.lit(None).cast("long")
    fields = [F.lit(kind).alias("kind"), F.col("topic").alias("topic"),
              (partition if partition is not None else F.lit(None)).cast("int").alias("partition"),
              (a if a is not None else long_null).cast("long").alias("a"),
              (key if key is not None else F.lit(None)).cast("string").alias("key"),
              (detail if detail is not None else F.lit(None)).cast("string").alias("detail")]
    fields += [(flags or {}).get(name, F.lit(0)).cast("int").alias(name) for name in _FLAGS]
    fields.append((bits if bits is not None else long_null).cast("long").alias("bits"))
    fields += [values.get(name, long_null).cast("long").alias(name) for name in _VALUES]
    return F.when(condition, F.struct(*fields))


def _aggregate(marked: DataFrame) -> DataFrame:
    """Every figure of one batch in one hash aggregation: a few rows per message, grouped by kind.

    _COUNTS: per (topic, latency), the counters and the latency histogram. _IDS: per (topic, word),
    the id words. _KEYS: per key, its highest id (x1), that id's first offset (x2) and the last
    offset of a message without an id (x3). _REVERSAL / _REPEAT / _PROBLEM: one row per flagged
    message (examples): id (x1), the other id (x3) and offset (x4), or the problem (detail).
    """
    has_id = F.col("outbox_id").isNotNull()
    where = {"partition": F.col("partition"), "a": F.col("offset"), "key": F.col("key")}
    rows = F.array(
        _row(_COUNTS, F.lit(True), a=F.col("latency_ms"), flags={
            "messages": F.lit(1), "with_id": _flag(has_id), "without_headers": _flag(F.col("problem").isNotNull()),
            "reversals": _flag(F.col("reversal")), "key_repeats": _flag(F.col("repeat")),
            "timed": _flag(F.col("latency_ms").isNotNull())}),
        _row(_IDS, has_id, a=id_words.word_of(F.col("outbox_id")), bits=id_words.bit_of(F.col("outbox_id"))),
        _row(_KEYS, F.col("is_top") | ~has_id, partition=F.col("partition"), key=F.col("key"),
             x1=F.when(F.col("is_top"), F.col("outbox_id")), x2=F.when(F.col("is_top"), F.col("offset")),
             x3=F.when(~has_id, F.col("offset"))),
        _row(_REVERSAL, F.col("reversal"), **where, x1=F.col("outbox_id"), x3=F.col("other_id"),
             x4=F.col("other_offset")),
        _row(_REPEAT, F.col("repeat"), **where, x1=F.col("outbox_id"), x3=F.col("other_id"),
             x4=F.col("other_offset")),
        _row(_PROBLEM, F.col("problem").isNotNull(), **where, detail=F.col("problem"), x1=F.col("outbox_id")),
    )
    exploded = marked.select(F.explode(rows).alias("r")).where(F.col("r").isNotNull()).select("r.*")
    return exploded.groupBy("kind", "topic", "partition", "a", "key", "detail").agg(
        *(F.sum(name).cast("bigint").alias(name) for name in _FLAGS),
        F.bit_or("bits").alias("bits"),
        *(function(name).alias(name) for name, function in _VALUES.items()))


def _examples_of(aggregated: DataFrame, batch_id: int, limit: int) -> DataFrame:
    """The first `limit` examples of each kind (by topic, partition, offset) in the examples' shape."""
    frames = []
    for kind, name in _EXAMPLE_KIND.items():
        rows = aggregated.where(F.col("kind") == kind).select(
            F.lit(name).alias("kind"), F.lit(batch_id).cast("bigint").alias("batch"), "topic", "partition",
            F.col("a").alias("offset"), "key", F.col("x1").alias("outbox_id"), F.col("x3").alias("other_id"),
            F.when(F.col("x3").isNotNull(), F.col("partition")).cast("int").alias("other_partition"),
            F.col("x4").alias("other_offset"), "detail")
        frames.append(rows.orderBy("topic", "partition", "offset").limit(limit))
    found = frames[0]
    for frame in frames[1:]:
        found = found.unionByName(frame)
    return found


def _keep_examples(frame: DataFrame, limit: int) -> DataFrame:
    keep = Window.partitionBy("kind").orderBy("batch", "topic", "partition", "offset")
    return frame.withColumn("_n", F.row_number().over(keep)).where(F.col("_n") <= limit).drop("_n")


def fold(state: AuditState | None, batch: DataFrame, *, batch_id: int = 0, examples: int = 10,
         latest: bool = False) -> AuditState:
    """The state after `batch` (normalized messages) on top of `state` (None: nothing seen yet).

    The checks read the batch once, in the first Spark job that uses the result; that job's
    aggregation (a few rows per key and per 64 ids) is persisted and listed in `cached`, and every
    frame of the result is derived from it and from `state`, lazily. With `latest` (or when
    `state` keeps it) the latest-state table is folded too, which reads the batch once more.
    """
    marked = mark(batch.select(*NARROW), state.keys if state is not None else None,
                  state.ids if state is not None else None)
    aggregated = _aggregate(marked).persist()
    of = {kind: aggregated.where(F.col("kind") == kind) for kind in (_COUNTS, _IDS, _KEYS)}
    counters = of[_COUNTS].groupBy("topic").agg(*(F.sum(name).cast("bigint").alias(name) for name in COUNTER_NAMES))
    ids = of[_IDS].select("topic", F.col("a").alias("word"), "bits")
    latency = of[_COUNTS].where(F.col("a").isNotNull()).select(
        "topic", F.col("a").alias("latency_ms"), F.col("timed").cast("bigint").alias("messages"))
    batch_keys = of[_KEYS].select("topic", "partition", "key", F.col("x1").alias("max_id"),
                                  F.col("x2").alias("max_id_offset"), F.col("x3").alias("last_plain_offset"))
    keys = batch_keys.where(F.col("max_id").isNotNull()).select("topic", "partition", "key", "max_id", "max_id_offset")
    found = _examples_of(aggregated, batch_id, examples)
    if state is not None:
        counters = counters.unionByName(state.counters).groupBy("topic").agg(
            *(F.sum(name).cast("bigint").alias(name) for name in COUNTER_NAMES))
        ids = id_words.merge(ids.unionByName(state.ids), "topic")
        highest = F.max(F.struct(F.col("max_id").alias("id"), (-F.col("max_id_offset")).alias("neg_offset")))
        keys = (keys.unionByName(state.keys).groupBy("topic", "partition", "key").agg(highest.alias("_max"))
                .select("topic", "partition", "key", F.col("_max.id").alias("max_id"),
                        (-F.col("_max.neg_offset")).alias("max_id_offset")))
        latency = latency.unionByName(state.latency).groupBy("topic", "latency_ms").agg(
            F.sum("messages").cast("bigint").alias("messages"))
        found = state.examples.unionByName(found)
    newest = None
    if latest or (state is not None and state.latest is not None):
        newest = latest_state.fold(state.latest if state is not None else None,
                                   state.keys if state is not None else None, batch, batch_keys)
    return AuditState(counters=counters, ids=ids, keys=keys, latency=latency,
                      examples=_keep_examples(found, examples), latest=newest, messages=batch, cached=[aggregated])


def other_duplicates(messages: DataFrame, limit: int, batch_id: int = 0) -> DataFrame:
    """Examples of repeats that the per-key pass does not see: an id under another key or partition.

    The first `limit` ids found in more than one (partition, key), each message of theirs outside
    the (partition, key) of the id's first occurrence (lowest partition, then offset). Costs a
    pass over the messages and a shuffle of the ids; run only when the counts show such repeats.
    """
    with_id = messages.where(F.col("outbox_id").isNotNull())
    place = F.struct("partition", "key")
    repeated = (with_id.groupBy("topic", "outbox_id")
                .agg(F.min(place).alias("lowest"), F.max(place).alias("highest"),
                     F.min(F.struct("partition", "offset", "key")).alias("first"))
                .where(F.col("lowest") != F.col("highest")).orderBy("topic", "outbox_id").limit(limit)
                .select("topic", "outbox_id", F.col("first.partition").alias("first_partition"),
                        F.col("first.offset").alias("first_offset"), F.col("first.key").alias("first_key")))
    repeats = (with_id.join(F.broadcast(repeated), ["topic", "outbox_id"])
               .where((F.col("partition") != F.col("first_partition"))
                      | ~F.col("key").eqNullSafe(F.col("first_key"))))
    return repeats.select(
        F.lit("duplicates").alias("kind"), F.lit(batch_id).cast("bigint").alias("batch"), "topic", "partition",
        "offset", "key", "outbox_id", F.col("outbox_id").alias("other_id"),
        F.col("first_partition").alias("other_partition"), F.col("first_offset").alias("other_offset"),
        F.lit(None).cast("string").alias("detail")).orderBy("topic", "partition", "offset").limit(limit)


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
    for row in state.ids.groupBy("topic").agg(id_words.total().alias("distinct")).collect():
        detail = topics.setdefault(row["topic"], {"duplicates": 0})
        detail["distinct_ids"] = row["distinct"]
        detail["duplicates"] = detail["duplicates"] - row["distinct"]
    say("latency percentiles")
    wanted = F.array(*(F.lit(p) for p in PERCENTILES))
    percentile = F.percentile(F.col("latency_ms"), wanted, F.col("messages")).alias("p")
    by_topic = state.latency.groupBy("topic").agg(percentile)
    overall = state.latency.agg(percentile).select(F.lit(None).cast("string").alias("topic"), "p")
    overall_values = None
    for row in by_topic.unionByName(overall).collect():
        if row["topic"] is None:
            overall_values = row["p"]
        else:
            topics.setdefault(row["topic"], {})["latency_ms"] = _percentiles(row["p"])

    say("collecting examples")
    found: dict[str, list[dict[str, Any]]] = {kind: [] for kind in EXAMPLE_KINDS}
    for row in state.examples.orderBy("kind", "batch", "topic", "partition", "offset").collect():
        found[row["kind"]].append(_example_dict(row))
    duplicates = sum(detail.get("duplicates", 0) for detail in topics.values())
    if duplicates > key_repeats and len(found["duplicates"]) < examples and state.messages is not None:
        say("looking for examples of the other duplicates")
        extra = other_duplicates(state.messages, examples - len(found["duplicates"])).collect()
        found["duplicates"].extend(_example_dict(row) for row in extra)

    findings = Findings(topics=topics, latency_ms=_percentiles(overall_values), examples=found)
    if ledger is not None:
        say("comparing with the ledger")
        findings.ledger_ids, findings.missing, findings.missing_examples = id_words.missing(
            state.ids, id_words.words(ledger), examples)
    return findings


def _example_dict(row: Any) -> dict[str, Any]:
    """One example for the report: where the message is and the ids involved (nulls left out)."""
    item = {"topic": row["topic"], "partition": row["partition"], "offset": row["offset"], "key": row["key"],
            "outbox_id": row["outbox_id"]}
    if row["kind"] == "reversals":
        item["after"] = {"outbox_id": row["other_id"], "partition": row["other_partition"],
                         "offset": row["other_offset"]}
    elif row["kind"] == "duplicates":
        item["first_seen"] = {"partition": row["other_partition"], "offset": row["other_offset"]}
    elif row["kind"] == "without_headers":
        item["problem"] = row["detail"]
        if item["outbox_id"] is None:
            del item["outbox_id"]
    return item
