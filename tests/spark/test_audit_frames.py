"""The audit's checks on small in-memory DataFrames: no Kafka, a local SparkSession."""

from __future__ import annotations

import datetime as dt

import pytest

from outbox.pipeline import audit
from tests.support.audit import CREATED, SENT, frame, message
from tests.support.spark_session import shared_session

pytestmark = pytest.mark.spark


@pytest.fixture(scope="session")
def spark():
    return shared_session()


def figures(spark, *batches, ledger=None):
    state = None
    for number, rows in enumerate(batches):
        state = audit.fold(state, frame(spark, rows), batch_id=number)
    ledger_frame = None if ledger is None else spark.createDataFrame([(i,) for i in ledger], "outbox_id long")
    return audit.summarize(state, ledger=ledger_frame)


def ids_in_order(key, *ids, partition=0, start=0, topic="t"):
    return [message(start + n, key, i, partition=partition, topic=topic) for n, i in enumerate(ids)]


def test_normalize_reads_headers_and_latency(spark):
    rows = frame(spark, [message(0, "k", 42, headers=[("trace", "abc")])]).collect()
    row = rows[0]
    assert (row["key"], row["value"], row["outbox_id"], row["problem"]) == ("k", "v", 42, None)
    assert row["create_time"] == dt.datetime(2026, 1, 1, 0, 0, 0, 900000)
    assert row["latency_ms"] == 100
    assert [tuple(h) for h in row["headers"]] == [("trace", "abc"), ("outbox-id", "42"),
                                                  ("outbox-create-time", CREATED)]


@pytest.mark.parametrize(("outbox_id", "created", "problem"), [
    (None, CREATED, "no outbox-id header"),
    ("12x", CREATED, "outbox-id is not an integer: 12x"),
    (7, None, "no outbox-create-time header"),
    (7, "yesterday", "outbox-create-time is not a timestamp: yesterday"),
])


def test_normalize_keeps_messages_with_bad_headers(spark, outbox_id, created, problem):
    rows = frame(spark, [message(0, "k", outbox_id, created=created)]).collect()
    assert len(rows) == 1
    assert rows[0]["problem"] == problem


def test_clean_stream_counts_nothing(spark):
    found = figures(spark, ids_in_order("a", 1, 3, 5) + ids_in_order("b", 2, 4, 6, start=3))
    assert found.topics["t"] == {"messages": 6, "without_headers": 0, "reversals": 0, "distinct_ids": 6,
                                 "duplicates": 0, "latency_ms": {"p50": 100.0, "p95": 100.0, "p99": 100.0}}
    assert found.examples == {"duplicates": [], "reversals": [], "without_headers": []}


def test_repeats_are_duplicates_not_reversals(spark):
    found = figures(spark, ids_in_order("k", 0, 1, 1, 2, 2, 2))  # R0 R1 R1 R2 R2 R2
    assert (found.topics["t"]["duplicates"], found.topics["t"]["reversals"]) == (3, 0)
    assert [(e["offset"], e["outbox_id"], e["first_seen"]["offset"]) for e in found.examples["duplicates"]] == [
        (2, 1, 1), (4, 2, 3), (5, 2, 3)]


@pytest.mark.parametrize(("ids", "reversals", "duplicates"), [
    ((0, 1, 2, 1, 2, 3), 0, 2),  # a repeated run after a failure with several records in flight
    ((0, 2, 1), 1, 0),           # 1 was never published before 2: it went back
    ((0, 1, 2, 0, 1), 0, 2),     # repeats of ids already published, however old
    ((0, 1, 1, 2), 0, 1),
    ((0, 2, 1, 1, 3, 2), 1, 2),  # the second 1 repeats the reversal: one reversal only
])


def test_a_reversal_is_a_first_occurrence_below_a_higher_id(spark, ids, reversals, duplicates):
    found = figures(spark, ids_in_order("k", *ids))
    assert (found.topics["t"]["reversals"], found.topics["t"]["duplicates"]) == (reversals, duplicates)


@pytest.mark.parametrize(("first", "second", "reversals", "duplicates"), [
    ((0, 1, 2), (1, 2, 3), 0, 2),
    ((0, 2), (1,), 1, 0),
    ((0, 1, 2), (0, 1), 0, 2),
    ((0, 1, 2, 1), (2, 3), 0, 2),
])


def test_the_rule_holds_across_batches(spark, first, second, reversals, duplicates):
    found = figures(spark, ids_in_order("k", *first), ids_in_order("k", *second, start=len(first)))
    assert (found.topics["t"]["reversals"], found.topics["t"]["duplicates"]) == (reversals, duplicates)


def test_a_reversal_names_a_higher_id_published_before_it(spark):
    found = figures(spark, ids_in_order("k", 0, 2, 1) + ids_in_order("j", 5, 6, start=3))  # R0 R2 R1
    assert found.examples["reversals"] == [
        {"topic": "t", "partition": 0, "offset": 2, "key": "k", "outbox_id": 1,
         "after": {"outbox_id": 2, "partition": 0, "offset": 1}}]
    assert found.examples["duplicates"] == []


def test_order_is_per_key_and_partition(spark):
    # Interleaved keys, and the same key in two partitions: neither is a reversal.
    rows = [message(0, "a", 10), message(1, "b", 1), message(2, "a", 11), message(3, "b", 2),
            message(0, "a", 5, partition=1)]
    assert figures(spark, rows).topics["t"]["reversals"] == 0


def test_two_batches_add_up_to_one(spark):
    first = ids_in_order("k", 1, 2, 3) + ids_in_order("j", 10, 11, start=3)
    second = ids_in_order("k", 3, 2, 4, start=5) + ids_in_order("j", 9, start=8)  # repeat, repeat, reversal
    once = figures(spark, first + second)
    twice = figures(spark, first, second)
    assert once.topics == twice.topics
    assert once.topics["t"]["reversals"] == 1
    assert once.topics["t"]["duplicates"] == 2

    def where(found):
        return {kind: [(e["partition"], e["offset"], e["outbox_id"]) for e in items]
                for kind, items in found.examples.items()}

    assert where(once) == where(twice) == {"reversals": [(0, 8, 9)], "duplicates": [(0, 5, 3), (0, 6, 2)],
                                           "without_headers": []}
    # Across batches the higher id named is the key's highest from the earlier ones.
    assert twice.examples["reversals"][0]["after"] == {"outbox_id": 11, "partition": 0, "offset": 4}
    assert twice.examples["duplicates"][0]["first_seen"] == {"partition": 0, "offset": 2}


def test_missing_ids_come_from_the_ledger(spark):
    found = figures(spark, ids_in_order("k", 1, 2, 4), ledger=[1, 2, 3, 4, 5, 5])
    assert (found.missing, found.missing_examples, found.ledger_ids) == (2, [3, 5], 5)


def test_ids_are_counted_per_topic(spark):
    found = figures(spark, ids_in_order("k", 1, 2) + ids_in_order("k", 1, 2, topic="u"))
    assert {topic: detail["duplicates"] for topic, detail in found.topics.items()} == {"t": 0, "u": 0}


def test_latency_percentiles(spark):
    rows = [message(n, "k", n, sent=SENT + dt.timedelta(milliseconds=n)) for n in range(100)]  # 100..199 ms
    found = figures(spark, rows)
    assert found.latency_ms == {"p50": 149.5, "p95": 194.05, "p99": 198.01}


def test_without_headers_are_counted_and_shown(spark):
    rows = [message(0, "k", 1), message(1, "k", None), message(2, "k", 2, created=None)]
    found = figures(spark, rows)
    assert found.topics["t"]["without_headers"] == 2
    assert found.topics["t"]["messages"] == 3
    assert [e.get("problem") for e in found.examples["without_headers"]] == [
        "no outbox-id header", "no outbox-create-time header"]


def test_first_occurrences_keep_the_lowest_place(spark):
    rows = [message(0, "k", 1, partition=1), message(5, "k", 1, partition=0, value="first"),
            message(6, "k", 1, partition=0, value="later"), message(7, "k", None, partition=0)]
    kept = audit.first_occurrences(frame(spark, rows)).collect()
    assert [(r["partition"], r["offset"], r["value"]) for r in kept] == [(0, 5, "first")]


def test_examples_are_capped(spark):
    rows = ids_in_order("k", 9, *range(8))  # 8 reversals after id 9
    state = audit.fold(None, frame(spark, rows), examples=3)
    found = audit.summarize(state, examples=3)
    assert found.topics["t"]["reversals"] == 8
    assert len(found.examples["reversals"]) == 3


def test_missing_ids_across_bitmap_buckets(spark):
    seen = [1, 32_767, 32_768, 40_000, 70_000, 5_000_000]
    expected = [*seen, 2, 32_769, 65_536, 65_537, 4_999_999]
    found = figures(spark, ids_in_order("k", *seen), ledger=expected)
    assert (found.missing, found.missing_examples) == (5, [2, 32_769, 65_536, 65_537, 4_999_999])
    assert found.topics["t"]["distinct_ids"] == 6


def test_repeats_under_another_partition_are_found_too(spark):
    rows = [message(0, "k", 1, partition=0), message(1, "k", 2, partition=0), message(0, "k", 1, partition=1),
            message(2, "k", 2, partition=0)]  # id 1 again in partition 1; id 2 again in its key
    found = figures(spark, rows)
    assert (found.topics["t"]["duplicates"], found.topics["t"]["reversals"]) == (2, 0)
    assert sorted((e["partition"], e["offset"], e["outbox_id"], e["first_seen"]["partition"],
                   e["first_seen"]["offset"]) for e in found.examples["duplicates"]) == [(0, 2, 2, 0, 1),
                                                                                        (1, 0, 1, 0, 0)]
