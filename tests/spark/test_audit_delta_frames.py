"""The Delta tables' logic on in-memory micro-batches (no Kafka, no stream): MERGE against the whole-table
rewrite and a plain-Python reference, for random micro-batches with repeats, reversals, tombstones,
messages without ids and keys that move between partitions."""

from __future__ import annotations

import random

import pytest

from outbox.pipeline import audit, delta_table, sink
from outbox.pipeline import latest as latest_state
from outbox.pipeline.state import StateStore
from tests.support.audit import frame, message, newest_by_reference
from tests.support.spark_session import shared_session

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def spark():
    return shared_session()


def random_batches(seed: int, batches: int = 3, size: int = 30) -> list[list[dict]]:
    """Micro-batches of messages as the reference takes them (partition, offset, key, outbox_id, value).

    Keys k0-k5 live in one partition each, except k4 and k5 which move to another now and then (a
    topic whose partition count changed); ids ascend, with repeats of a key's earlier message, ids
    published late (reversals), tombstones, and messages without an id (never for a key that has
    none at all in more than one partition: see docs/audit.md on --tombstones).
    """
    rng = random.Random(seed)
    offsets = [0, 0, 0]
    sent: list[dict] = []
    next_id, held_back = 1, []
    found = []
    for _ in range(batches):
        batch = []
        for _ in range(size):
            key = f"k{rng.randrange(6)}"
            partition = int(key[1]) % 3 if key not in ("k4", "k5") or rng.random() < 0.7 else 2 - int(key[1]) % 3
            roll = rng.random()
            earlier = [m for m in sent if m["key"] == key and m["partition"] == partition and m["outbox_id"]]
            if roll < 0.15 and earlier:
                outbox_id, value = (chosen := rng.choice(earlier))["outbox_id"], chosen["value"]  # a repeat
            elif roll < 0.22 and held_back:
                outbox_id, value = held_back.pop(), f"{key}-late"  # published after higher ids: a reversal
            elif roll < 0.3 and earlier:
                outbox_id, value = None, f"{key}-plain-{offsets[partition]}"
            else:
                outbox_id, next_id = next_id, next_id + 1
                if rng.random() < 0.08:
                    held_back.append(outbox_id)
                    continue
                value = None if rng.random() < 0.15 else f"{key}-{outbox_id}"
            item = {"partition": partition, "offset": offsets[partition], "key": key, "outbox_id": outbox_id,
                    "value": value}
            offsets[partition] += 1
            sent.append(item)
            batch.append(item)
        found.append(batch)
    return found


def as_rows(batch: list[dict]) -> list[tuple]:
    return [message(m["offset"], m["key"], m["outbox_id"], partition=m["partition"], value=m["value"]) for m in batch]


def table_of(rows: list) -> dict[str, tuple[str | None, int | None]]:
    assert len(rows) == len({row["key"] for row in rows})
    return {row["key"]: (row["value"], row["outbox_id"]) for row in rows}


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "tombstones"), [(1, "delete"), (2, "mark")])
def test_merging_each_batch_gives_the_rewritten_table_and_the_reference(spark, tmp_path, seed, tombstones):
    """Each micro-batch as follow.py runs it: folded, saved as a state version, then the tables written.
    Slow: a MERGE and a state version per micro-batch, each a few Spark jobs."""
    merged, appended = str(tmp_path / "latest"), str(tmp_path / "sink")
    store = StateStore(spark, str(tmp_path / "state"))
    before, sent = None, []
    for batch_id, batch in enumerate(random_batches(seed)):
        sent.extend(batch)
        messages = frame(spark, as_rows(batch))
        folded = audit.fold(before, messages, batch_id=batch_id, latest=True)
        commit = delta_table.Commit(app_id="test", batch_id=batch_id)

        def write_tables(saved: audit.AuditState, before=before, folded=folded, messages=messages, commit=commit):
            assert folded.batch_keys is not None
            if before is None:
                latest_state.write(latest_state.fold(None, None, messages, folded.batch_keys), merged,
                                   table_format="delta", tombstones=tombstones, commit=commit)
            else:
                changed = latest_state.changes(before.keys, messages, folded.batch_keys)
                latest_state.merge(spark, merged, changed, commit, tombstones)
            sink.append(messages, before.ids if before else None, appended, commit)

        before = store.save(batch_id, folded, {}, before_marking=write_tables)
        folded.release()

        expected = newest_by_reference(sent, tombstones=tombstones)
        assert before.latest is not None
        assert table_of(latest_state.table(before.latest, tombstones).collect()) == expected, f"batch {batch_id}"
        rows = spark.read.format("delta").load(merged).collect()
        assert table_of(rows) == expected, f"batch {batch_id}"
        if tombstones == "mark":
            assert {row["key"] for row in rows if row["deleted"]} == {k for k, (v, _) in expected.items() if v is None}
        ids = [row["outbox_id"] for row in spark.read.format("delta").load(appended).select("outbox_id").collect()]
        assert sorted(ids) == sorted({m["outbox_id"] for m in sent if m["outbox_id"] is not None})
    assert {m["value"] for m in sent} >= {None}  # the batches had tombstones
