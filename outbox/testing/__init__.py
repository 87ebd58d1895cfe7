"""What your own tests need from the outbox: the records your code stashed, a harvest of them with the real engine,
and the same for queues; no Kafka, no thread, no sleep. docs/testing.md shows it all.

    from outbox.testing import assert_stashed, capture_stashed, harvest

    def test_paying_an_order_announces_it(client):
        with capture_stashed() as stashed:
            client.post("/orders/42/pay")
        assert_stashed("orders", key="42", value={"status": "paid"}, records=stashed)
        [message] = harvest()                  # published by the real engine, to an in-memory Kafka

Rows are read through your test's own database connection, so what a `TestCase` (or pytest-django's
`db`) test stashed is seen although its transaction never commits. Under those, `stash()` raises
`OutsideTransaction` when the only `atomic()` around it is the test framework's own, as it does in
production: a view that forgot `transaction.atomic()` fails its test (OUTBOX["tests_require_atomic"] =
False turns that off). Queues: `capture_sent()` (what `queue.send()` would publish) and
`handle_message()` (a handler run as `outbox_consume` runs it, the inbox included), in queues.py; the
harvest in harvesting.py. With pytest-django, the plugin (plugin.py) gives fixtures: `outbox_stashed`,
`outbox_harvest`.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ANY", "Handled", "Published", "SentMessage", "StashedRecord", "assert_stashed", "capture_sent",
           "capture_stashed", "handle_message", "harvest", "stashed"]
#: Names loaded on first use (the engine, the queues), by the module that has them.
_LAZY = {"harvest": "harvesting", "Published": "harvesting", "capture_sent": "queues", "handle_message": "queues",
         "Handled": "queues", "SentMessage": "queues"}


class _Any:
    """Matches anything (`assert_stashed(topic, key=ANY)`)."""

    def __eq__(self, other: object) -> bool:
        return True

    def __repr__(self) -> str:
        return "ANY"


ANY: Any = _Any()


@dataclass(frozen=True)
class StashedRecord:
    """One record in the outbox, as stash() wrote it and the harvester will publish it."""

    id: int
    topic: str
    key: str
    #: The message's value as it will be published (JSON text for a dict or list; None for a tombstone).
    value: str | None
    headers: list[tuple[str, str]] = field(default_factory=list)

    def json(self) -> Any:
        """The value decoded as JSON."""
        return None if self.value is None else json.loads(self.value)

    def header(self, name: str) -> str | None:
        """The last header of that name, if any."""
        found = [value for key, value in self.headers if key == name]
        return found[-1] if found else None


def __getattr__(name: str) -> Any:
    """The harvest and the queues' helpers load the engine and the queues only when asked for."""
    if name in _LAZY:
        return getattr(importlib.import_module(f"outbox.testing.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'outbox.testing' has no attribute {name!r}")


def stashed(topic: str | None = None, *, after: int = 0, using: str | None = None) -> list[StashedRecord]:
    """The records in the outbox now (of `topic`, with an id above `after`), in id order, read through the test's
    own connection to database `using` (default OUTBOX["database"])."""
    from outbox import conf
    from outbox.models import OutboxRecord

    rows = OutboxRecord.objects.using(using or conf.database_alias()).filter(id__gt=after).order_by("id")
    if topic is not None:
        rows = rows.filter(kafka_topic=topic)
    return [StashedRecord(row.id, row.kafka_topic, row.kafka_key, row.kafka_value, row.headers) for row in rows]


@contextmanager
def capture_stashed(*, topic: str | None = None, using: str | None = None) -> Iterator[list[StashedRecord]]:
    """The records stashed inside the block (of `topic`), in a list filled in when the block ends: Django's
    captureOnCommitCallbacks, for the outbox."""
    from django.db.models import Max

    from outbox import conf
    from outbox.models import OutboxRecord

    alias = using or conf.database_alias()
    start = OutboxRecord.objects.using(alias).aggregate(last=Max("id"))["last"] or 0
    records: list[StashedRecord] = []
    try:
        yield records
    finally:
        records.extend(stashed(topic=topic, after=start, using=alias))


def assert_stashed(topic: str, key: Any = ANY, value: Any = ANY, *, headers: Mapping[str, str] | None = None,
                   records: Sequence[StashedRecord] | None = None, count: int | None = None) -> list[StashedRecord]:
    """Assert that a record of `topic` with this key and value (a dict or list is compared as JSON; ANY matches
    anything) and these headers (each must be there) was stashed: among `records`, else among the records in the
    outbox now. With `count`, exactly that many must match. Returns the matches; the AssertionError lists what
    was stashed."""
    pool = list(records) if records is not None else stashed()
    found = [record for record in pool if record.topic == topic and key == record.key
             and _value_matches(value, record) and all(record.header(name) == wanted
                                                       for name, wanted in (headers or {}).items())]
    if (count is None and found) or (count is not None and len(found) == count):
        return found
    wanted = f"{count if count is not None else 'a'} record(s) of topic {topic!r}"
    wanted += "" if key is ANY else f" with key {key!r}"
    wanted += "" if value is ANY else f" and value {value!r}"
    wanted += f" and headers {dict(headers)!r}" if headers else ""
    shown = "\n".join(f"  #{r.id} {r.topic} {r.key!r}: {_short(r.value)} {dict(r.headers) or ''}" for r in pool[:20])
    more = f"\n  ... and {len(pool) - 20} more" if len(pool) > 20 else ""
    raise AssertionError(f"expected {wanted}, found {len(found)} among the {len(pool)} stashed"
                         + (f":\n{shown}{more}" if pool else ""))


def _value_matches(wanted: Any, record: StashedRecord) -> bool:
    if wanted is ANY:
        return True
    if isinstance(wanted, dict | list):
        try:
            return bool(wanted == record.json())
        except ValueError:
            return False
    if isinstance(wanted, bytes):
        return record.value is not None and wanted == record.value.encode()
    return bool(wanted == record.value)


def _short(value: str | None, limit: int = 80) -> str:
    if value is None:
        return "None (a tombstone)"
    return repr(value) if len(value) <= limit else repr(value[:limit]) + "..."
