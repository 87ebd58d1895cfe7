"""Transaction-aware writes to the outbox: the record commits or rolls back with the caller's changes.

The table's trigger (migration 0003) sends the NOTIFY that wakes a listening harvester, for these
writes and for any other writer's alike; like the rows, it is only delivered if the caller commits.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from itertools import islice
from typing import Any

from django.db import connections

from outbox import cloudevents, conf
from outbox.errors import InvalidRecord, OutsideTransaction
from outbox.harvest.contract import Record
from outbox.models import OutboxRecord
from outbox.tracing.propagation import add_headers, current_headers
from outbox.tracing.switch import tracing_on
from outbox.validation import clean

#: Rows per INSERT statement in stash_many(); larger batches are split.
BATCH_SIZE = 1000
RECORD_FIELDS = frozenset({"topic", "key", "value", "headers", "cloudevent"})


def stash(topic: str, key: str, value: Any = None,
          headers: Mapping[str, str] | Iterable[tuple[str, str]] | None = None, *, using: str | None = None,
          cloudevent: Mapping[str, str] | bool | None = None) -> int:
    """Write one record in the caller's transaction on database `using` (default OUTBOX["database"]);
    returns its outbox id.

    `value` is str, bytes (UTF-8), None (a tombstone), or a dict/list sent as JSON.
    `headers` is a mapping or a sequence of (name, value) string pairs; order and repeats are kept.
    With OpenTelemetry on (docs/tracing.md), the current span's context is added to them.
    `cloudevent` publishes the record as a CloudEvent (binary mode): a mapping with type, source,
    id, subject, content_type; True for OUTBOX["cloudevents"]'s; None as that setting says for the topic.
    """
    using = using or conf.database_alias()
    _require_transaction(using)
    limits = _limits()
    row = clean(topic, key, value, headers, **limits)
    _decorate(row, cloudevent, current_headers() if tracing_on() else None, bool(cloudevents.configured()))
    return _insert(using, [row])[0]


def stash_many(records: Iterable[Mapping[str, Any]], *, using: str | None = None) -> list[int]:
    """Write many records (mappings with stash()'s parameter names) in the caller's transaction.

    Records are validated first, all of them, so a bad one writes nothing. Returns the outbox
    ids in the order given; ids increase in that order, so one key's records keep their order.
    """
    using = using or conf.database_alias()
    _require_transaction(using, "stash_many()")
    limits = _limits()
    context = current_headers() if tracing_on() else None
    events = bool(cloudevents.configured())
    rows = [_clean_mapping(record, index, limits, context, events) for index, record in enumerate(records)]
    ids: list[int] = []
    iterator = iter(rows)
    while batch := list(islice(iterator, BATCH_SIZE)):
        ids.extend(_insert(using, batch))
    return ids


def _clean_mapping(record: Any, index: int, limits: dict[str, int], context: list[tuple[str, str]] | None,
                   events: bool) -> Record:
    prefix = f"records[{index}]."
    if not isinstance(record, Mapping):
        raise InvalidRecord(f"records[{index}]", f"must be a mapping with keys topic, key, value, headers, cloudevent, "
                                                 f"got {type(record).__name__}")
    unknown = set(record) - RECORD_FIELDS
    if unknown:
        raise InvalidRecord(f"records[{index}]", f"unknown field(s) {sorted(map(str, unknown))}; "
                                                 f"allowed: topic, key, value, headers, cloudevent")
    for required in ("topic", "key"):
        if required not in record:
            raise InvalidRecord(f"{prefix}{required}", "is required")
    row = clean(record["topic"], record["key"], record.get("value"), record.get("headers"), prefix=prefix, **limits)
    _decorate(row, record.get("cloudevent"), context, events, prefix)
    return row


def _decorate(row: Record, cloudevent: Any, context: list[tuple[str, str]] | None, events: bool,
              prefix: str = "") -> None:
    """Headers the outbox adds to a cleaned record: CloudEvents' (`events`: OUTBOX["cloudevents"] is set) and the
    trace context (both read once a call)."""
    if cloudevent is not None or events:
        cloudevents.add_headers(row, cloudevent, prefix)
    if context:
        add_headers(row, context)


def _limits() -> dict[str, int]:
    return {"max_value_bytes": conf.setting("max_value_bytes"), "max_header_bytes": conf.setting("max_header_bytes")}


def _require_transaction(using: str, caller: str = "stash()") -> None:
    if not in_transaction(using):
        raise OutsideTransaction(
            f"{caller} must run inside transaction.atomic(): the outbox record is only atomic with your "
            "other changes when both are in one transaction"
        )


def in_transaction(using: str) -> bool:
    """Whether code on database `using` runs in a transaction of its own: an atomic() block, or autocommit
    turned off by hand. Under Django's TestCase (and pytest-django's `db`) the test's own atomic blocks do not
    count (Django marks them `_from_testcase`, on 5.2 and 6.1), so code that forgot atomic() fails its test as
    it would fail in production; OUTBOX["tests_require_atomic"] = False lets those blocks count."""
    connection = connections[using]
    if not connection.in_atomic_block:
        return not connection.get_autocommit()
    if not conf.setting("tests_require_atomic"):
        return True
    return any(not getattr(block, "_from_testcase", False) for block in connection.atomic_blocks)


def _insert(using: str, rows: Sequence[Record]) -> list[int]:
    table = OutboxRecord._meta.db_table
    if len(rows) == 1:
        row = rows[0]
        with connections[using].cursor() as cursor:
            cursor.execute(_insert_one_sql(table), (row.topic, row.key, row.value, row.header_keys, row.header_values))
            return [cursor.fetchone()[0]]
    params = (
        [row.topic for row in rows],
        [row.key for row in rows],
        [row.value for row in rows],
        [array_literal(row.header_keys) for row in rows],
        [array_literal(row.header_values) for row in rows],
    )
    with connections[using].cursor() as cursor:
        cursor.execute(_insert_sql(table), params)
        return [row_id for (row_id,) in cursor.fetchall()]


def array_literal(items: list[str]) -> str:
    """A Postgres text[] literal; every element quoted, so commas, braces, spaces and NULL stay text."""
    if not items:
        return "{}"
    return "{" + ",".join('"' + item.replace("\\", "\\\\").replace('"', '\\"') + '"' for item in items) + "}"


@lru_cache(maxsize=8)
def _insert_one_sql(table: str) -> str:
    """stash()'s single row: plain VALUES plan faster than the array form below."""
    columns = "kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values"
    return f'INSERT INTO "{table}" ({columns}) VALUES (%s, %s, %s, %s::text[], %s::text[]) RETURNING id'


@lru_cache(maxsize=8)
def _insert_sql(table: str) -> str:
    """One INSERT for any number of rows: five array parameters, whatever the row count.

    Parsing thousands of placeholders cost more than the insert itself, so columns travel as
    arrays and are unnested server-side; header lists (ragged, so not a 2-D array) travel as
    array literals cast to text[] per row, which measured cheaper than JSON. WITH
    ORDINALITY ... ORDER BY assigns ids in the caller's order.
    """
    return (
        f'INSERT INTO "{table}" (kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values) '
        f"SELECT r.topic, r.key, r.value, "
        f"r.header_keys::text[], r.header_values::text[] "
        f"FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::text[]) "
        f"WITH ORDINALITY AS r(topic, key, value, header_keys, header_values, n) "
        f"ORDER BY r.n RETURNING id"
    )
