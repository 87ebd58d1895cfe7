"""Checks and normalises a record before it reaches SQL, so a refusal leaves the caller's transaction usable."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder

from outbox.errors import InvalidRecord
from outbox.harvest.contract import Record
from outbox.kafka.headers import RESERVED_HEADERS
from outbox.kafka.names import MAX_TOPIC_LENGTH, is_topic_name
from outbox.models import MAX_KEY_LENGTH


def clean(topic: Any, key: Any, value: Any, headers: Any, *, max_value_bytes: int, max_header_bytes: int,
          prefix: str = "") -> Record:
    """Validate one record; raise InvalidRecord naming the field (with `prefix`) and the limit."""
    if type(topic) is not str or topic not in _valid_topics:
        _check_topic(topic, prefix)
    if not isinstance(key, str):
        raise InvalidRecord(f"{prefix}key", f"must be a str, got {type(key).__name__}")
    if not key:
        raise InvalidRecord(f"{prefix}key", "must not be empty (a key orders records and picks the partition)")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidRecord(f"{prefix}key", f"must be at most {MAX_KEY_LENGTH} characters, got {len(key)}")
    _no_nul(f"{prefix}key", key)
    utf8_size(f"{prefix}key", key)
    text = _value_text(value, prefix)
    if text is not None:
        size = utf8_size(f"{prefix}value", text)
        if size > max_value_bytes:
            raise InvalidRecord(f"{prefix}value", f"must be at most {max_value_bytes} bytes in UTF-8, got {size}")
        _no_nul(f"{prefix}value", text)
    header_keys, header_values = _headers(headers, max_header_bytes, prefix)
    return Record(None, None, topic, key, text, header_keys, header_values)


#: Topic names already checked; applications use few, so most records skip the regex.
_valid_topics: set[str] = set()
_MAX_REMEMBERED_TOPICS = 10_000


def _check_topic(topic: Any, prefix: str) -> None:
    if not is_topic_name(topic):
        raise InvalidRecord(f"{prefix}topic", f"must be a Kafka topic name: 1 to {MAX_TOPIC_LENGTH} characters "
                                              f"of a-z A-Z 0-9 . _ - (not '.' or '..'), got {_show(topic)}")
    if len(_valid_topics) < _MAX_REMEMBERED_TOPICS:
        _valid_topics.add(topic)


def _value_text(value: Any, prefix: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        try:
            return bytes(value).decode()
        except UnicodeDecodeError as error:
            raise InvalidRecord(f"{prefix}value", f"bytes must be valid UTF-8 ({error.reason} at byte "
                                                  f"{error.start})") from None
    if isinstance(value, dict | list):
        try:
            # allow_nan=False: NaN and Infinity are not JSON (RFC 8259); Java, Go, JavaScript and Spark's
            # from_json refuse or null them, long after this transaction committed.
            return json.dumps(value, cls=DjangoJSONEncoder, ensure_ascii=False, separators=(",", ":"),
                              allow_nan=False)
        except ValueError as error:
            if "not JSON compliant" in str(error):
                raise InvalidRecord(f"{prefix}value", "must not contain NaN or Infinity: JSON (RFC 8259) has no "
                                                      "such numbers (send null or a string)") from None
            raise InvalidRecord(f"{prefix}value", f"is not serialisable as JSON: {error}") from None
        except TypeError as error:
            raise InvalidRecord(f"{prefix}value", f"is not serialisable as JSON: {error}") from None
        except RecursionError:
            raise InvalidRecord(f"{prefix}value", "is nested too deeply to serialise as JSON") from None
    raise InvalidRecord(f"{prefix}value", f"must be str, bytes, dict, list or None, got {type(value).__name__}")


def _headers(headers: Any, max_header_bytes: int, prefix: str) -> tuple[list[str], list[str]]:
    if headers is None:
        return [], []
    if isinstance(headers, Mapping):
        pairs: Iterable[Any] = headers.items()
    elif isinstance(headers, str | bytes) or not isinstance(headers, Iterable):
        raise InvalidRecord(f"{prefix}headers", f"must be a mapping or a sequence of (str, str) pairs, "
                                                f"got {type(headers).__name__}")
    else:
        pairs = headers
    keys: list[str] = []
    values: list[str] = []
    size = 0
    for index, pair in enumerate(pairs):
        field = f"{prefix}headers[{index}]"
        if isinstance(pair, str | bytes) or not isinstance(pair, tuple | list) or len(pair) != 2:
            raise InvalidRecord(field, f"must be a pair of strings (name, value), got {_show(pair)}")
        name, text = pair
        if not isinstance(name, str) or not isinstance(text, str):
            raise InvalidRecord(field, f"must be a pair of strings (name, value), got "
                                       f"({type(name).__name__}, {type(text).__name__})")
        if not name:
            raise InvalidRecord(field, "name must not be empty")
        if name in RESERVED_HEADERS:
            raise InvalidRecord(field, f"name {name!r} is reserved: the harvester adds it to every message")
        _no_nul(field, name)
        _no_nul(field, text)
        size += utf8_size(f"{field} name", name) + utf8_size(f"{field} value", text)
        keys.append(name)
        values.append(text)
    if size > max_header_bytes:
        raise InvalidRecord(f"{prefix}headers", f"must be at most {max_header_bytes} bytes in UTF-8 "
                                                f"in all, got {size}")
    return keys, values


def utf8_size(field: str, text: str) -> int:
    """The size of `text` in UTF-8; InvalidRecord if it cannot be encoded (a lone surrogate, as text
    that went through a bad decoder carries: neither Postgres nor Kafka's consumers can take it)."""
    if text.isascii():
        return len(text)
    try:
        return len(text.encode())
    except UnicodeEncodeError as error:
        raise InvalidRecord(field, f"must be valid Unicode: a lone surrogate {text[error.start]!r} at character "
                                   f"{error.start} has no UTF-8 form") from None


def _no_nul(field: str, text: str) -> None:
    if "\x00" in text:
        raise InvalidRecord(field, "must not contain NUL characters (Postgres text cannot store them)")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
