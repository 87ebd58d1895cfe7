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

How it runs (see docs/benchmarks.md for what each choice saved): the messages are read once,
without a shuffle: each Kafka partition arrives whole in one task, and a key always lands in one
partition, so scan.py checks each task's keys in numpy (through `mapInArrow`) and answers with
a few rows per key, per 64 ids and per millisecond of latency, plus the first few examples.
Spark merges those in one small aggregation, the only result that is cached for the figures.
Messages from elsewhere (tests, a Kafka source splitting partitions) are shuffled by key first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyspark import cloudpickle
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from outbox.pipeline import ids as id_words
from outbox.pipeline import latest as latest_state
from outbox.pipeline import scan

cloudpickle.register_pickle_by_value(scan)  # executors need numpy and pyarrow, not this package

ID_HEADER = "outbox-id"
CREATE_TIME_HEADER = "outbox-create-time"
PERCENTILES = (0.5, 0.95, 0.99)
EXAMPLE_KINDS = ("duplicates", "reversals", "without_headers")

COUNTER_NAMES = ("messages", "with_id", "without_headers", "reversals", "key_repeats")
COUNTERS_SCHEMA = "topic string, " + ", ".join(f"{name} long" for name in COUNTER_NAMES)
IDS_SCHEMA = f"topic string, {id_words.SCHEMA}"
KEYS_SCHEMA = "topic string, partition int, key string, max_id long, max_id_offset long"
LATENCY_SCHEMA = "topic string, latency_ms long, messages long"
EXAMPLES_SCHEMA = ("kind string, batch long, topic string, partition int, offset long, key string, outbox_id long, "
                   "other_id long, other_partition int, other_offset long, detail string")
EXAMPLE_COLUMNS = [part.split()[0] for part in EXAMPLES_SCHEMA.split(", ")]

_EXAMPLE_KIND = {scan.REVERSAL: "reversals", scan.REPEAT: "duplicates", scan.PROBLEM: "without_headers"}
_VALUES = {"x1": F.max, "x2": F.min, "x3": F.max, "x4": F.max}  # what they mean per kind: scan.py, above ROW_SCHEMA
_ROW_COLUMNS = tuple(part.split()[0] for part in scan.ROW_SCHEMA.split(", "))


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
    `examples` (the first few per kind and task; per kind after a second batch), and, when kept, `latest`
    (latest.py: each key's newest record). `messages`
    is the last batch's messages (for the rare look-up of repeats under other keys) and `batch_keys`
    its per-key summary (for latest.py), usable only while `cached` (persisted frames) is not released.
    """

    counters: DataFrame
    ids: DataFrame
    keys: DataFrame
    latency: DataFrame
    examples: DataFrame
    latest: DataFrame | None = None
    messages: DataFrame | None = None
    batch_keys: DataFrame | None = None
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
        self.batch_keys = None


def empty_state(spark: SparkSession, *, latest: bool = False) -> AuditState:
    return AuditState(**{name: spark.createDataFrame([], schema) for name, schema in AuditState.SCHEMAS.items()
                         if latest or name != "latest"})


def _join_on_key(left: DataFrame, right: DataFrame, *, prefix: str) -> DataFrame:
    """`left` with `right`'s other columns, matched on (topic, partition, key); a null key matches a null key."""
    renamed = right.select(*(F.col(name).alias(prefix + name) for name in right.columns))
    condition = [left["topic"] == renamed[prefix + "topic"], left["partition"] == renamed[prefix + "partition"],
                 left["key"].eqNullSafe(renamed[prefix + "key"])]
    joined = left.join(renamed, condition, "left")
    return joined.drop(*(prefix + name for name in ("topic", "partition", "key")))


def _scanned(messages: DataFrame, keys: DataFrame | None, ids: DataFrame | None, *, whole_partitions: bool,
             examples: int, topics: Sequence[str] | None) -> DataFrame:
    """The rows of scan.py for `messages`, with its candidates decided by `ids` (the earlier batches' words).

    `whole_partitions`: every Kafka partition of `messages` is in one Spark partition, as Spark's
    Kafka source reads them; otherwise the messages are first shuffled so that each key's are.
    `topics`, when known, lets each message carry a small number instead of its topic's name.
    """
    narrow = messages.select("topic", "partition", "offset", "key", "outbox_id", "latency_ms", "problem")
    if not whole_partitions:
        narrow = narrow.repartition("topic", "partition", "key")
    if keys is not None:
        prior = keys.select("topic", "partition", "key", F.col("max_id").alias("id"),
                            F.col("max_id_offset").alias("offset"))
        narrow = _join_on_key(narrow, prior, prefix="prior_")
    if topics:
        names = F.array(*(F.lit(name) for name in topics))
        narrow = narrow.withColumn("topic", F.array_position(names, F.col("topic")))
    check = functools.partial(scan.scan, examples=examples, topics=list(topics) if topics else None)
    rows = narrow.select(*(name for name in scan.INPUT if name in narrow.columns)).mapInArrow(check, scan.ROW_SCHEMA)
    if keys is None or ids is None:
        return rows
    candidate = F.col("kind") == scan.CANDIDATE
    lookup = ids.select(F.col("topic").alias("_seen_topic"), F.col("word").alias("_seen_word"),
                        F.col("bits").alias("_seen_bits"))
    rows = rows.join(lookup, (F.col("topic") == F.col("_seen_topic"))
                     & (id_words.word_of(F.col("x1")) == F.col("_seen_word")) & candidate, "left")
    seen = candidate & id_words.contains(F.col("_seen_bits"), F.col("x1"))
    unseen = candidate & ~seen
    decided = {  # an id published in an earlier batch is a repeat, else the candidate is a reversal
        "kind": F.when(seen, F.lit(scan.REPEAT)).when(unseen, F.lit(scan.REVERSAL)).otherwise(F.col("kind")),
        "reversals": F.when(unseen, F.lit(1).cast("long")).otherwise(F.col("reversals")),
        "key_repeats": F.when(seen, F.lit(1).cast("long")).otherwise(F.col("key_repeats")),
        "x3": F.when(seen, F.col("x1")).otherwise(F.col("x3")),
        "x4": F.when(seen, F.lit(None).cast("long")).otherwise(F.col("x4")),
    }
    return rows.select(*(decided.get(name, F.col(name)).alias(name) for name in _ROW_COLUMNS))


def _aggregate(rows: DataFrame) -> DataFrame:
    """scan.py's rows of every task merged: one row per kind and what identifies it."""
    return rows.groupBy("kind", "topic", "partition", "a", "key", "detail").agg(
        *(F.sum(name).cast("bigint").alias(name) for name in scan.FLAGS),
        F.bit_or("bits").alias("bits"),
        *(function(name).alias(name) for name, function in _VALUES.items()))


def _examples_of(aggregated: DataFrame, batch_id: int) -> DataFrame:
    """The example rows of one batch in the examples' shape (`_keep_examples` keeps the first few)."""
    kind = F.col("kind")
    name = F.lit(None).cast("string")
    for number, label in _EXAMPLE_KIND.items():
        name = F.when(kind == number, F.lit(label)).otherwise(name)
    return aggregated.where(kind.isin(*_EXAMPLE_KIND)).select(
        name.alias("kind"), F.lit(batch_id).cast("bigint").alias("batch"), "topic", "partition",
        F.col("a").alias("offset"), "key", F.col("x1").alias("outbox_id"), F.col("x3").alias("other_id"),
        F.when(F.col("x3").isNotNull(), F.col("partition")).cast("int").alias("other_partition"),
        F.col("x4").alias("other_offset"), "detail")


def _keep_examples(frame: DataFrame, limit: int) -> DataFrame:
    keep = Window.partitionBy("kind").orderBy("batch", "topic", "partition", "offset")
    return frame.withColumn("_n", F.row_number().over(keep)).where(F.col("_n") <= limit).drop("_n")


def fold(state: AuditState | None, batch: DataFrame, *, batch_id: int = 0, examples: int = 10,
         latest: bool = False, whole_partitions: bool = False, topics: Sequence[str] | None = None) -> AuditState:
    """The state after `batch` (normalized messages) on top of `state` (None: nothing seen yet).

    The checks read the batch once, in the first Spark job that uses the result; that job's
    aggregation (a few rows per key and per 64 ids) is persisted and listed in `cached`, and every
    frame of the result is derived from it and from `state`, lazily. With `latest` (or when
    `state` keeps it) the latest-state table is folded too, which reads the batch once more.
    """
    rows = _scanned(batch, state.keys if state is not None else None, state.ids if state is not None else None,
                    whole_partitions=whole_partitions, examples=examples, topics=topics)
    aggregated = _aggregate(rows).persist()
    of = {kind: aggregated.where(F.col("kind") == kind) for kind in (scan.COUNTS, scan.IDS, scan.KEYS)}
    # Counting rows carry their counts, decided candidates a 1; every other row 0.
    counters = aggregated.groupBy("topic").agg(*(F.sum(name).cast("bigint").alias(name) for name in COUNTER_NAMES))
    ids = of[scan.IDS].select("topic", F.col("a").alias("word"), "bits")
    latency = of[scan.COUNTS].where(F.col("a").isNotNull()).select(
        "topic", F.col("a").alias("latency_ms"), F.col("timed").cast("bigint").alias("messages"))
    batch_keys = of[scan.KEYS].select("topic", "partition", "key", F.col("x1").alias("max_id"),
                                      F.col("x2").alias("max_id_offset"), F.col("x3").alias("last_plain_offset"))
    keys = batch_keys.where(F.col("max_id").isNotNull()).select("topic", "partition", "key", "max_id", "max_id_offset")
    found = _examples_of(aggregated, batch_id)
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
    # A first batch has at most `examples` of each kind per task (scan.py): few enough to keep them all.
    kept = _keep_examples(found, examples) if state is not None else found
    return AuditState(counters=counters, ids=ids, keys=keys, latency=latency, examples=kept, latest=newest,
                      messages=batch, batch_keys=batch_keys, cached=[aggregated])


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
    say("counting distinct ids and duplicates, latency percentiles")
    # One job for both: id words and latency rows side by side, per topic and (the rollup's null topic) overall.
    none = F.lit(None).cast("long")
    rows = state.ids.select("topic", "bits", none.alias("latency_ms"), none.alias("messages")).unionByName(
        state.latency.select("topic", none.alias("bits"), "latency_ms", "messages"))
    wanted = F.array(*(F.lit(p) for p in PERCENTILES))
    figures = rows.rollup("topic").agg(id_words.total().alias("distinct"),
                                       F.percentile(F.col("latency_ms"), wanted, F.col("messages")).alias("p"))
    overall_values = None
    for row in figures.collect():
        if row["topic"] is None:
            overall_values = row["p"]
            continue
        detail = topics.setdefault(row["topic"], {"duplicates": 0, "latency_ms": _percentiles(None)})
        if row["distinct"]:
            detail["distinct_ids"] = row["distinct"]
            detail["duplicates"] = detail.get("duplicates", 0) - row["distinct"]
        detail["latency_ms"] = _percentiles(row["p"])

    say("collecting examples")
    found: dict[str, list[dict[str, Any]]] = {kind: [] for kind in EXAMPLE_KINDS}
    # A few rows per kind: sorted here, which spares Spark a sampling job for a global sort.
    order = ("batch", "topic", "partition", "offset")
    for row in sorted(state.examples.collect(), key=lambda row: tuple((row[name] is not None, row[name])
                                                                      for name in order)):
        if len(found[row["kind"]]) < examples:
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
