"""Hypothesis strategies for what applications hand to stash() and the queue's publish, and what Kafka
must then hold for each accepted record, byte for byte."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from confluent_kafka import Consumer, TopicPartition
from hypothesis import strategies as st

from outbox.kafka.names import TOPIC_PATTERN
from tests.support.harness import wait_until

#: Any code point, lone surrogates and NUL included (st.text() leaves surrogates out by default).
ANY_CHARACTER = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=())
TEXT = st.text(ANY_CHARACTER, max_size=40) | st.text(max_size=40)
#: Text stash() takes: no lone surrogate, no NUL.
GOOD_TEXT = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=40)


def mostly(good: st.SearchStrategy[Any], anything: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Usually `good`, sometimes `anything`: most examples should get as far as Kafka."""
    return st.integers(0, 4).flatmap(lambda n: good if n else anything)


def _json(text: st.SearchStrategy[str], nan: bool) -> st.SearchStrategy[Any]:
    scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
               | st.floats(allow_nan=nan, allow_infinity=nan) | text)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
                        max_leaves=12)


JSON = _json(TEXT, nan=True)
GOOD_JSON = _json(GOOD_TEXT, nan=False)
VALUES = mostly(
    st.none() | GOOD_TEXT | GOOD_TEXT.map(str.encode) | st.lists(GOOD_JSON, max_size=4)
    | st.dictionaries(GOOD_TEXT, GOOD_JSON, max_size=4),
    TEXT | st.binary(max_size=60) | st.lists(JSON, max_size=4) | st.dictionaries(TEXT, JSON, max_size=4)
    | st.integers() | st.floats())
GOOD_NAMES = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), min_size=1,
                     max_size=12).filter(lambda name: name not in {"outbox-id", "outbox-create-time"}
                                         and not name.startswith("mq-"))
HEADERS = mostly(
    st.none() | st.lists(st.tuples(GOOD_NAMES, GOOD_TEXT), max_size=4)
    | st.dictionaries(GOOD_NAMES, GOOD_TEXT, max_size=3),
    st.lists(st.tuples(TEXT, TEXT), max_size=4) | st.dictionaries(TEXT, TEXT, max_size=3)
    | st.lists(st.one_of(st.tuples(TEXT), st.tuples(TEXT, st.integers()), TEXT), max_size=2))


def topics(valid: Sequence[str]) -> st.SearchStrategy[Any]:
    """One of the `valid` topics (created beforehand), or something no topic may be called."""
    invalid = TEXT.filter(lambda t: not TOPIC_PATTERN.fullmatch(t) or t in {".", ".."}) | st.integers() | st.none()
    return mostly(st.sampled_from(list(valid)), invalid)


def records(valid_topics: Sequence[str]) -> st.SearchStrategy[dict[str, Any]]:
    keys = mostly(GOOD_TEXT.filter(bool), TEXT | st.integers() | st.none())
    return st.fixed_dictionaries({"topic": topics(valid_topics), "key": keys},
                                 optional={"value": VALUES, "headers": HEADERS})


def expected_value(value: Any) -> bytes | None:
    """What Kafka holds for an accepted value (None: a tombstone)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return None  # JSON: compared as data, see same_value()


def same_value(sent: Any, held: bytes | None) -> bool:
    if isinstance(sent, dict | list):
        return held is not None and json.loads(held) == sent
    return held == expected_value(sent)


def expected_headers(headers: Any) -> list[tuple[str, bytes]]:
    pairs = headers.items() if isinstance(headers, dict) else headers or []
    return [(name, value.encode()) for name, value in pairs]


class TopicReader:
    """Reads topics from the beginning, keeping every message by a header's value (outbox-id, mq-id)."""

    def __init__(self, bootstrap: str, topics: Sequence[str], header: str) -> None:
        self.header = header
        self.found: dict[str, list[Any]] = {}
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"fuzz-{uuid.uuid4().hex}",
                                  "enable.auto.commit": False, "auto.offset.reset": "earliest"})
        metadata = self.consumer.list_topics(timeout=30)
        self.consumer.assign([TopicPartition(topic, p, 0) for topic in topics
                              for p in metadata.topics[topic].partitions])

    def read(self, ids: Sequence[str], what: str) -> list[Any]:
        """The messages carrying `ids`, waiting (with a deadline) until each has arrived once."""

        def arrived() -> bool:
            for message in self.consumer.consume(500, timeout=0.2):
                if message.error() is None:
                    value = dict(message.headers() or []).get(self.header)
                    if value is not None:
                        self.found.setdefault(value.decode(), []).append(message)
            return all(record_id in self.found for record_id in ids)

        wait_until(arrived, 60, what, interval=0)
        return [self.found[record_id] for record_id in ids]

    def close(self) -> None:
        self.consumer.close()
