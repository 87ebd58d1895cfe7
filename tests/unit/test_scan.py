"""scan.py, the audit's per-task checks in numpy, against the ordering rule written out in plain Python.

No JVM: the function gets Arrow batches as `mapInArrow` would hand them over.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import pyarrow as pa
import pytest

from outbox.pipeline import scan

INPUT_SCHEMA = pa.schema([("topic", pa.string()), ("partition", pa.int32()), ("offset", pa.int64()),
                          ("key", pa.string()), ("outbox_id", pa.int64()), ("latency_ms", pa.int64()),
                          ("problem", pa.string()), ("prior_id", pa.int64()), ("prior_offset", pa.int64())])


def rows_of(messages, *, examples=1000, batch_rows=7, topics=None):
    """scan.scan over `messages` (dicts of INPUT columns), sent in small batches; the rows as dicts."""
    table = pa.Table.from_pylist(messages, schema=INPUT_SCHEMA)
    if topics is not None:
        positions = [topics.index(name) + 1 for name in table["topic"].to_pylist()]
        table = table.set_column(0, "topic", pa.array(positions, pa.int64()))
    out = list(scan.scan(iter(table.to_batches(max_chunksize=batch_rows)), examples, topics))
    return pa.Table.from_batches(out).to_pylist() if out else []


def message(offset, key, outbox_id, *, topic="t", partition=0, latency=5, problem=None, prior=None):
    return {"topic": topic, "partition": partition, "offset": offset, "key": key, "outbox_id": outbox_id,
            "latency_ms": latency, "problem": problem, "prior_id": prior and prior[0],
            "prior_offset": prior and prior[1]}


def decide(rows, earlier_ids):
    """What audit.py does with candidates: a repeat if an earlier batch had the id, else a reversal."""
    counts = Counter()
    for row in rows:
        if row["kind"] == scan.COUNTS and row["a"] is None:
            counts["reversals"] += row["reversals"]
            counts["key_repeats"] += row["key_repeats"]
        if row["kind"] == scan.CANDIDATE:
            counts["key_repeats" if row["x1"] in earlier_ids else "reversals"] += 1
    return counts


def reference(messages, earlier_ids):
    """The rule, message by message in offset order per key (docs/audit.md, "What is checked")."""
    counts = Counter()
    by_key = defaultdict(list)
    for item in messages:
        by_key[item["topic"], item["partition"], item["key"]].append(item)
    for items in by_key.values():
        seen, highest = set(), None
        for item in sorted(items, key=lambda m: m["offset"]):
            outbox_id, prior = item["outbox_id"], item["prior_id"]
            if outbox_id is None:
                continue
            repeat = outbox_id in seen or outbox_id == prior or (
                prior is not None and outbox_id < prior and outbox_id in earlier_ids)
            if repeat:
                counts["key_repeats"] += 1
            elif (highest is not None and outbox_id < highest) or (prior is not None and outbox_id < prior):
                counts["reversals"] += 1
            seen.add(outbox_id)
            highest = outbox_id if highest is None else max(highest, outbox_id)
    return counts


def of_kind(rows, kind):
    return [row for row in rows if row["kind"] == kind]


def test_a_reversal_names_the_earliest_higher_id_before_it():
    rows = rows_of([message(0, "k", 5), message(1, "k", 7), message(2, "k", 6), message(3, "k", 3)])
    reversals = sorted((row["a"], row["x1"], row["x3"], row["x4"]) for row in of_kind(rows, scan.REVERSAL))
    assert reversals == [(2, 6, 7, 1), (3, 3, 5, 0)]


def test_repeats_point_at_the_first_offset_of_their_id():
    rows = rows_of([message(0, "k", 1), message(1, "k", 2), message(2, "k", 1), message(3, "k", 2)])
    assert sorted((row["a"], row["x1"], row["x4"]) for row in of_kind(rows, scan.REPEAT)) == [(2, 1, 0), (3, 2, 1)]
    assert not of_kind(rows, scan.REVERSAL)


def test_keys_are_told_apart_by_topic_partition_and_key_and_a_null_key_is_a_key():
    messages = [message(0, "k", 2), message(1, None, 1), message(0, "k", 1, partition=1),
                message(1, "k", 1, topic="u"), message(2, None, 2)]
    rows = rows_of(messages)
    assert decide(rows, set()) == Counter()
    keys = {(row["topic"], row["partition"], row["key"]): (row["x1"], row["x2"]) for row in of_kind(rows, scan.KEYS)}
    assert keys == {("t", 0, "k"): (2, 0), ("t", 0, None): (2, 2), ("t", 1, "k"): (1, 0), ("u", 0, "k"): (1, 1)}


def test_earlier_batches_make_candidates_below_the_keys_prior_id():
    prior = (10, 4)
    rows = rows_of([message(5, "k", 10, prior=prior), message(6, "k", 8, prior=prior),
                    message(7, "k", 12, prior=prior)])
    assert [(row["a"], row["x1"], row["x3"], row["x4"]) for row in of_kind(rows, scan.CANDIDATE)] == [(6, 8, 10, 4)]
    assert [(row["a"], row["x4"]) for row in of_kind(rows, scan.REPEAT)] == [(5, 4)]  # the prior id itself
    assert decide(rows, {8}) == Counter(key_repeats=2) and decide(rows, set()) == Counter(key_repeats=1, reversals=1)


def test_ids_become_words_and_latency_a_histogram():
    rows = rows_of([message(0, "k", 1, latency=3), message(1, "k", 2, latency=3), message(2, "k", 64, latency=None),
                    message(3, "k", 63, latency=-2, topic="u")])
    words = {(row["topic"], row["a"]): row["bits"] for row in of_kind(rows, scan.IDS)}
    assert words == {("t", 0): 0b110, ("t", 1): 1, ("u", 0): -(1 << 63)}  # bit 63: a negative long, as in Spark
    latency = {(row["topic"], row["a"]): row["messages"] for row in of_kind(rows, scan.COUNTS)}
    assert latency == {("t", 3): 2, ("t", None): 1, ("u", -2): 1, ("u", None): 0}


def test_messages_without_an_id_count_and_give_the_keys_last_plain_offset():
    rows = rows_of([message(0, "k", None, problem="no outbox-id header"), message(1, "k", 4),
                    message(2, "k", None, problem="no outbox-id header"), message(3, "j", None, problem="x")])
    totals = of_kind(rows, scan.COUNTS)
    assert sum(row["messages"] for row in totals) == 4 and sum(row["without_headers"] for row in totals) == 3
    plain = {row["key"]: row["x3"] for row in of_kind(rows, scan.KEYS) if row["x3"] is not None}
    assert plain == {"k": 2, "j": 3}
    assert sorted(row["a"] for row in of_kind(rows, scan.PROBLEM)) == [0, 2, 3]


def test_examples_are_the_first_by_topic_partition_and_offset():
    messages = [message(n, f"k{n % 3}", 100 - n, partition=n % 2, topic="b" if n < 10 else "a") for n in range(20)]
    rows = rows_of(messages, examples=3)
    # Ids fall as offsets rise, so every message after the first of its (topic, partition, key) is a reversal.
    group = defaultdict(list)
    for m in messages:
        group[m["topic"], m["partition"], m["key"]].append(m["offset"])
    firsts = sorted((topic, partition, offset) for (topic, partition, _), offsets in group.items()
                    for offset in sorted(offsets)[1:])
    shown = sorted((row["topic"], row["partition"], row["a"]) for row in of_kind(rows, scan.REVERSAL))
    assert shown == firsts[:3]
    assert decide(rows, set())["reversals"] == len(firsts)


def test_topics_given_as_positions_come_back_as_names():
    messages = [message(0, "k", 2, topic="b"), message(1, "k", 1, topic="b"), message(0, "k", 1, topic="a")]
    rows = rows_of(messages, topics=["a", "b"])
    assert {row["topic"] for row in rows} == {"a", "b"}
    assert [row["topic"] for row in of_kind(rows, scan.REVERSAL)] == ["b"]


@pytest.mark.parametrize("seed", range(60))
def test_random_streams_agree_with_the_plain_rule(seed):
    chance = random.Random(seed)
    keys = ["a", "b", None]
    priors = {(p, k): (chance.randint(1, 30), chance.randint(0, 5)) for p in range(2) for k in keys
              if chance.random() < 0.5}
    earlier_ids = {i for i in range(1, 31) if chance.random() < 0.3}
    messages, offsets = [], Counter()
    for _ in range(chance.randint(1, 80)):
        partition, key = chance.randint(0, 1), chance.choice(keys)
        outbox_id = None if chance.random() < 0.1 else chance.randint(1, 40)
        messages.append(message(offsets[partition] + 10, key, outbox_id, partition=partition,
                                prior=priors.get((partition, key))))
        offsets[partition] += 1
    chance.shuffle(messages)  # a task's rows need not come in offset order
    rows = rows_of(messages, batch_rows=chance.randint(1, 9))
    assert decide(rows, earlier_ids) == +reference(messages, earlier_ids)
    with_ids = [m for m in messages if m["outbox_id"] is not None]
    assert sum(row["with_id"] for row in of_kind(rows, scan.COUNTS)) == len(with_ids)
    for row in of_kind(rows, scan.REVERSAL):  # the other message is a higher id of the key, earlier
        other = [m for m in with_ids if (m["partition"], m["key"], m["offset"]) == (row["partition"], row["key"],
                                                                                   row["x4"])]
        assert other and other[0]["outbox_id"] == row["x3"] > row["x1"] and row["x4"] < row["a"]
