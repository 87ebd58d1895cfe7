"""The audit's pass over one task's messages: every check that needs a key's messages in order.

Spark's Kafka source reads each Kafka partition into one task, and a key always lands in one
partition, so a task holds every message of its keys and the per-key order needs no shuffle.
`scan()` (run by `mapInArrow`) sorts the task's messages once, by key and id, and answers with a
few rows per key, per 64 ids and per millisecond of latency, shaped as `ROW_SCHEMA`; Spark then
merges those small rows across tasks (audit.py). For a message, "before" means a lower offset in
its key's partition; a message is:

- a repeat when its key had its id before, in this batch or as the key's highest id of the
  earlier batches (`prior_id`);
- a reversal when it is not a repeat and its key had a higher id before it;
- a candidate when it is the batch's first of an id below `prior_id`: an earlier batch may have
  published that id (a repeat) or not (a reversal), which only the earlier batches' id words
  tell, so Spark decides it (audit.py).

Reversals and repeats are counted here; at most `examples` of each kind per task are returned
as rows (the first by topic, partition and offset: the global first few are among them), and
every candidate. This module imports only numpy and pyarrow, and audit.py ships it to the
executors by value: workers need PySpark's own Arrow support, not this package.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

COUNTS, IDS, KEYS, REVERSAL, REPEAT, PROBLEM, CANDIDATE = range(7)
FLAGS = ("messages", "with_id", "without_headers", "reversals", "key_repeats", "timed")
VALUES = ("x1", "x2", "x3", "x4")
INPUT = ("topic", "partition", "offset", "key", "outbox_id", "latency_ms", "problem", "prior_id", "prior_offset")

_ARROW = pa.schema(
    [("kind", pa.int32()), ("topic", pa.string()), ("partition", pa.int32()), ("a", pa.int64()),
     ("key", pa.string()), ("detail", pa.string())]
    + [(name, pa.int64()) for name in (*FLAGS, "bits", *VALUES)])
# What each row means, by kind (columns not listed are null or 0):
# COUNTS: per (topic, a = latency ms): `messages` and `timed`; per topic with a null `a`: the messages
#   without a latency, and the `with_id`, `without_headers`, `reversals`, `key_repeats` totals.
# IDS: per (topic, a = word): `bits` (ids.py's words).
# KEYS: per (topic, partition, key): its highest id (x1), the first offset of that id (x2), the last
#   offset of a message without an id (x3).
# REVERSAL / REPEAT / PROBLEM / CANDIDATE: one message (partition, a = offset, key): its id (x1), the
#   other id (x3) and offset (x4) involved, or the problem (detail).
_SPARK_TYPES = {pa.int32(): "int", pa.int64(): "long", pa.string(): "string"}
ROW_SCHEMA = ", ".join(f"{field.name} {_SPARK_TYPES[field.type]}" for field in _ARROW)

_NO_ROW = np.iinfo(np.int64).max


def scan(batches: Iterable[pa.RecordBatch], examples: int,
         topics: Sequence[str] | None = None) -> Iterator[pa.RecordBatch]:
    """`mapInArrow`'s function: the rows for one task's messages (columns `INPUT`).

    With `topics`, the `topic` column holds 1-based positions in it rather than names (cheaper to
    send); without the `prior_*` columns no key has a prior id.
    """
    received = list(batches)
    if not received:
        return
    table = pa.Table.from_batches(received)
    del received  # one copy of the messages at a time: the batches go once they are combined
    table = table.combine_chunks()
    if table.num_rows:
        checked = _Scan(table, examples, topics)
        del table
        yield from checked.rows().to_batches()


def _longs(column: Any) -> tuple[np.ndarray, np.ndarray]:
    """(values with nulls as 0, mask of the non-null ones) as int64 arrays."""
    return (pc.fill_null(column, 0).to_numpy().astype(np.int64, copy=False),
            pc.is_valid(column).to_numpy(zero_copy_only=False))


def _codes(column: Any) -> tuple[np.ndarray, pa.Array]:
    """Dictionary codes (-1 for null) and the distinct values, for grouping strings as integers."""
    encoded = column.dictionary_encode()
    if isinstance(encoded, pa.ChunkedArray):
        encoded = encoded.combine_chunks()
    return pc.fill_null(encoded.indices, -1).to_numpy().astype(np.int64), encoded.dictionary


def _starts(*sorted_columns: np.ndarray) -> np.ndarray:
    """Where a new group begins in rows sorted by `sorted_columns` (a boolean per row)."""
    size = len(sorted_columns[0])
    new = np.zeros(size, bool)
    if size:
        new[0] = True
        for column in sorted_columns:
            new[1:] |= column[1:] != column[:-1]
    return new


class _Scan:
    """One task's messages as numpy arrays, and the rows they give."""

    def __init__(self, table: pa.Table, examples: int, topics: Sequence[str] | None) -> None:
        self.examples = examples
        if topics is None:
            codes, names = _codes(table["topic"])
        else:
            codes, names = table["topic"].to_numpy().astype(np.int64) - 1, pa.array(list(topics), pa.string())
            if len(codes) and (codes.min() < 0 or codes.max() >= len(names)):
                raise ValueError(f"a message of a topic not in {list(topics)}")
        # Topics by name, so that "the first examples" means what Spark's orderBy("topic", ...) means.
        by_name = np.argsort(np.array(names.to_pylist(), dtype=object)) if len(names) else np.array([], np.int64)
        rank = np.empty(len(names), np.int64)
        rank[by_name] = np.arange(len(names))
        self.topic_names = names.take(pa.array(by_name, pa.int64()))
        self.topic = rank[codes]
        self.topics = len(names)
        self.partition = table["partition"].to_numpy().astype(np.int64)
        self.offset = table["offset"].to_numpy().astype(np.int64)
        self.key, self.key_names = _codes(table["key"])
        self.ids, self.has_id = _longs(table["outbox_id"])
        self.latency, self.timed = _longs(table["latency_ms"])
        self.problem = table["problem"]
        self.has_problem = pc.is_valid(self.problem).to_numpy(zero_copy_only=False)
        if "prior_id" in table.column_names:
            self.prior, self.has_prior = _longs(table["prior_id"])
            self.prior_offset, _ = _longs(table["prior_offset"])
        else:
            self.prior = self.prior_offset = np.zeros(table.num_rows, np.int64)
            self.has_prior = np.zeros(table.num_rows, bool)
        self.parts: list[pa.Table] = []

    # -- output ---------------------------------------------------------------------------------

    def _emit(self, kind: int, topic: np.ndarray, **columns: Any) -> None:
        """Rows of one kind: `topic` as ranks, other columns as numpy arrays or (array, mask) pairs."""
        size = len(topic)
        if not size:
            return
        arrays = {"kind": pa.array(np.full(size, kind, np.int32)),
                  "topic": self.topic_names.take(pa.array(topic, pa.int64()))}
        for field in _ARROW:
            if field.name in arrays:
                continue
            value = columns.get(field.name)
            if value is None:  # counts not given are 0, anything else null
                arrays[field.name] = (pa.array(np.zeros(size, np.int64)) if field.name in FLAGS
                                      else pa.nulls(size, field.type))
            elif isinstance(value, (pa.Array, pa.ChunkedArray)):
                arrays[field.name] = value
            elif isinstance(value, tuple):
                arrays[field.name] = pa.array(value[0], field.type, mask=~value[1])
            else:
                arrays[field.name] = pa.array(value, field.type)
        self.parts.append(pa.Table.from_pydict(arrays, schema=_ARROW))

    def _keys_of(self, codes: np.ndarray) -> pa.Array:
        return self.key_names.take(pa.array(codes, pa.int64(), mask=codes < 0))

    def rows(self) -> pa.Table:
        self._order_checks()
        self._problems()
        self._plain_keys()
        self._words()
        self._latency()
        return pa.concat_tables(self.parts) if self.parts else _ARROW.empty_table()

    # -- the checks -----------------------------------------------------------------------------

    def _order_checks(self) -> None:
        """Repeats, reversals, candidates and each key's highest id, over the messages with an id."""
        rows = np.flatnonzero(self.has_id)
        order = rows[np.lexsort((self.offset[rows], ~self.ids[rows], self.key[rows], self.partition[rows],
                                 self.topic[rows]))]  # per key, ids descending (~ never overflows), offsets ascending
        t, p, k = self.topic[order], self.partition[order], self.key[order]
        i, o = self.ids[order], self.offset[order]
        size = len(order)
        new_key = _starts(t, p, k)
        new_id = new_key | _starts(i)
        repeat_here = ~new_id
        run_start = np.maximum.accumulate(np.where(new_id, np.arange(size), 0)) if size else np.zeros(0, np.int64)
        # The rows before a row of its key are its key's higher ids (and earlier copies of its own). A running
        # minimum of the offsets' ranks tells whether one of them came at a lower offset; every key is lifted
        # above the keys after it, so that the minimum never reaches into an earlier key. Ranks (not offsets)
        # keep the lifted values below 2**62.
        key_number = np.cumsum(new_key) - 1
        rank = np.empty(size, np.int64)
        rank[np.argsort(o, kind="stable")] = np.arange(size)
        lifted = (key_number[-1] + 1 - key_number) * size + rank if size else rank
        running = np.minimum.accumulate(lifted) if size else lifted
        before = np.empty(size, np.int64)
        if size:
            before[0], before[1:] = _NO_ROW, running[:-1]
        higher_here = before < lifted

        prior, has_prior = self.prior[order], self.has_prior[order]
        same_as_prior = has_prior & (i == prior)
        repeat = repeat_here | same_as_prior
        candidate = new_id & has_prior & (i < prior)
        reversal = ~repeat & ~candidate & higher_here

        self._counts(t, repeat, reversal)
        starts = np.flatnonzero(new_key)
        self._emit(KEYS, t[starts], partition=p[starts], key=self._keys_of(k[starts]), x1=i[starts], x2=o[starts])

        chosen = self._first_examples(t, p, o, reversal)
        lowest = [self._earliest_before(lifted, new_key, j) for j in chosen]
        self._emit(REVERSAL, t[chosen], partition=p[chosen], a=o[chosen], key=self._keys_of(k[chosen]),
                   x1=i[chosen], x3=np.array([i[j] for j in lowest], np.int64),
                   x4=np.array([o[j] for j in lowest], np.int64))
        chosen = self._first_examples(t, p, o, repeat)
        here = repeat_here[chosen]
        prior_offset = self.prior_offset[order]
        self._emit(REPEAT, t[chosen], partition=p[chosen], a=o[chosen], key=self._keys_of(k[chosen]), x1=i[chosen],
                   x3=i[chosen], x4=np.where(here, o[run_start[chosen]], prior_offset[chosen]))
        chosen = np.flatnonzero(candidate)
        self._emit(CANDIDATE, t[chosen], partition=p[chosen], a=o[chosen], key=self._keys_of(k[chosen]),
                   x1=i[chosen], x3=prior[chosen], x4=prior_offset[chosen])

    def _earliest_before(self, lifted: np.ndarray, new_key: np.ndarray, row: int) -> int:
        """The row of the lowest offset among the rows before `row` in its key (a reversal has one)."""
        start = row
        while not new_key[start]:
            start -= 1
        return start + int(np.argmin(lifted[start:row]))

    def _first_examples(self, t: np.ndarray, p: np.ndarray, o: np.ndarray, flagged: np.ndarray) -> np.ndarray:
        """The flagged rows, or the first `examples` of them by topic, partition and offset."""
        rows = np.flatnonzero(flagged)
        if len(rows) > self.examples:
            rows = rows[np.lexsort((o[rows], p[rows], t[rows]))[:self.examples]]
        return rows

    def _counts(self, t: np.ndarray, repeat: np.ndarray, reversal: np.ndarray) -> None:
        """Per topic, the counters (latency aside) in one COUNTS row with a null latency."""
        def per_topic(topics: np.ndarray) -> np.ndarray:
            return np.bincount(topics, minlength=self.topics).astype(np.int64)[present]

        present = np.unique(self.topic)
        self._emit(COUNTS, present,
                   messages=per_topic(self.topic[~self.timed]), with_id=per_topic(self.topic[self.has_id]),
                   without_headers=per_topic(self.topic[self.has_problem]),
                   reversals=per_topic(t[reversal]), key_repeats=per_topic(t[repeat]))

    def _problems(self) -> None:
        """The first messages whose headers are missing or unusable (the counts are in `_counts`)."""
        chosen = self._first_examples(self.topic, self.partition, self.offset, self.has_problem)
        self._emit(PROBLEM, self.topic[chosen], partition=self.partition[chosen], a=self.offset[chosen],
                   key=self._keys_of(self.key[chosen]), detail=self.problem.take(pa.array(chosen, pa.int64())),
                   x1=(self.ids[chosen], self.has_id[chosen]))

    def _plain_keys(self) -> None:
        """Per key, the last offset of a message without an id (the latest-state table needs it)."""
        rows = np.flatnonzero(~self.has_id)
        order = rows[np.lexsort((self.offset[rows], self.key[rows], self.partition[rows], self.topic[rows]))]
        t, p, k = self.topic[order], self.partition[order], self.key[order]
        last = np.flatnonzero(np.append(_starts(t, p, k)[1:], True)) if len(order) else np.zeros(0, np.int64)
        self._emit(KEYS, t[last], partition=p[last], key=self._keys_of(k[last]), x3=self.offset[order][last])

    def _words(self) -> None:
        """Per topic, the ids as 64-bit words (ids.py): a bitwise or of each word's ids."""
        rows = np.flatnonzero(self.has_id)
        ids = self.ids[rows]
        words = ids >> 6
        bits = np.left_shift(np.uint64(1), (ids & 63).astype(np.uint64))
        order = np.lexsort((words, self.topic[rows]))
        t, words, bits = self.topic[rows][order], words[order], bits[order]
        starts = np.flatnonzero(_starts(t, words))
        merged = np.bitwise_or.reduceat(bits, starts) if len(starts) else bits
        self._emit(IDS, t[starts], a=words[starts], bits=merged.view(np.int64))

    def _latency(self) -> None:
        """Per topic, how many messages took each whole millisecond."""
        rows = np.flatnonzero(self.timed)
        order = np.lexsort((self.latency[rows], self.topic[rows]))
        t, latency = self.topic[rows][order], self.latency[rows][order]
        starts = np.flatnonzero(_starts(t, latency))
        counts = np.diff(np.append(starts, len(t)))
        self._emit(COUNTS, t[starts], a=latency[starts], messages=counts, timed=counts)
