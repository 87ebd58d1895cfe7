"""stash() and stash_many() against real Postgres: atomic with the caller's transaction, or nothing."""

from __future__ import annotations

import json
import select

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection, transaction

from outbox import InvalidRecord, OutsideTransaction, stash, stash_many
from outbox.harvest.contract import notify_channel
from outbox.models import OutboxRecord

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def keys() -> list[str]:
    return list(OutboxRecord.objects.order_by("id").values_list("kafka_key", flat=True))


def test_committed_stash_is_visible_to_another_connection(database_url):
    with transaction.atomic():
        record_id = stash("orders", "k1", "v1")
        with psycopg.connect(database_url) as other:
            assert other.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
    with psycopg.connect(database_url) as other:
        row = other.execute("SELECT id, kafka_topic, kafka_key, kafka_value, leader_id FROM outbox").fetchone()
    assert row == (record_id, "orders", "k1", "v1", None)


def test_rolled_back_stash_leaves_nothing():
    with pytest.raises(RuntimeError), transaction.atomic():
        stash("orders", "k1", "v1")
        raise RuntimeError("business logic failed")
    assert keys() == []


def test_savepoint_rollback_keeps_the_outer_record():
    with transaction.atomic():
        stash("orders", "outer-1")
        with pytest.raises(RuntimeError), transaction.atomic():
            stash("orders", "inner")
            raise RuntimeError("inner block failed")
        stash("orders", "outer-2")
    assert keys() == ["outer-1", "outer-2"]


def test_outside_atomic_raises_and_writes_nothing():
    with pytest.raises(OutsideTransaction, match=r"transaction\.atomic"):
        stash("orders", "k1", "v1")
    with pytest.raises(OutsideTransaction):
        stash_many([{"topic": "orders", "key": "k1"}])
    assert keys() == []


BAD_RECORDS = [
    ({"topic": "bad topic!"}, "topic"),
    ({"topic": ""}, "topic"),
    ({"topic": "t" * 250}, "topic"),
    ({"topic": ".."}, "topic"),
    ({"key": ""}, "key"),
    ({"key": 42}, "key"),
    ({"key": "k" * 1001}, "key"),
    ({"key": "nul\x00"}, "key"),
    ({"value": "v" * 900_001}, "value"),
    ({"value": "é" * 450_001}, "value"),
    ({"value": b"\xff\xfe"}, "value"),
    ({"value": 3.14}, "value"),
    ({"value": {"when": object()}}, "value"),
    ({"value": "nul\x00"}, "value"),
    ({"headers": [("only-one",)]}, "headers[0]"),
    ({"headers": [("name", 1)]}, "headers[0]"),
    ({"headers": "name=value"}, "headers"),
    ({"headers": {"outbox-id": "7"}}, "headers[0]"),
    ({"headers": [("", "v")]}, "headers[0]"),
    ({"headers": {"big": "x" * 70_000}}, "headers"),
    # Not JSON (RFC 8259): consumers in Java, Go, JavaScript and Spark refuse or null these.
    ({"value": {"price": float("nan")}}, "value"),
    ({"value": [1, float("inf")]}, "value"),
    ({"value": {"deep": {"deeper": [float("-inf")]}}}, "value"),
    # Lone surrogates (text that went through a bad decoder) have no UTF-8 form.
    ({"key": "k\ud800"}, "key"),
    ({"value": "v\udfff"}, "value"),
    ({"value": {"name": "\ud83d"}}, "value"),
    ({"value": {"\ud800": 1}}, "value"),
    ({"headers": [("trace\ud800", "v")]}, "headers[0] name"),
    ({"headers": [("ok", "fine"), ("trace", "\udc80")]}, "headers[1] value"),
]


@pytest.mark.parametrize(("override", "field"), BAD_RECORDS)
def test_invalid_record_names_the_field_and_leaves_the_transaction_usable(override, field):
    record = {"topic": "orders", "key": "k", "value": "v", **override}
    with transaction.atomic():
        stash("orders", "before")
        with pytest.raises(InvalidRecord) as raised:
            stash(**record)
        assert raised.value.field == field
        assert str(raised.value).startswith(f"{field}: ")
        assert isinstance(raised.value, ValueError)
        stash("orders", "after")  # the transaction is still usable
    assert keys() == ["before", "after"]


def test_limit_is_named_in_the_message():
    with transaction.atomic(), pytest.raises(InvalidRecord, match=r"key: must be at most 1000 characters, got 1001"):
        stash("orders", "k" * 1001)
    with transaction.atomic(), pytest.raises(InvalidRecord, match=r"at most 900000 bytes"):
        stash("orders", "k", "v" * 900_001)


def test_nan_and_surrogates_are_named_in_one_line():
    with transaction.atomic():
        with pytest.raises(InvalidRecord, match=r"^value: must not contain NaN or Infinity: JSON \(RFC 8259\)"):
            stash("orders", "k", {"price": float("nan")})
        with pytest.raises(InvalidRecord, match=r"^records\[1\]\.key: must be valid Unicode: a lone surrogate "
                                                r"'\\ud800' at character 1 has no UTF-8 form$"):
            stash_many([{"topic": "orders", "key": "a"}, {"topic": "orders", "key": "k\ud800"}])
        stash("orders", "still-usable")
    assert keys() == ["still-usable"]


def test_stash_many_validates_everything_before_writing():
    with transaction.atomic():
        with pytest.raises(InvalidRecord, match=r"^records\[2\]\.key: must not be empty"):
            stash_many([{"topic": "orders", "key": "a"}, {"topic": "orders", "key": "b"},
                        {"topic": "orders", "key": ""}])
        stash("orders", "still-usable")
    assert keys() == ["still-usable"]


def test_stash_many_rejects_unknown_fields_and_non_mappings():
    with transaction.atomic():
        with pytest.raises(InvalidRecord, match=r"records\[0\]: unknown field"):
            stash_many([{"topic": "orders", "key": "a", "kye": "b"}])
        with pytest.raises(InvalidRecord, match=r"records\[0\]: must be a mapping"):
            stash_many([("orders", "a")])
        with pytest.raises(InvalidRecord, match=r"records\[0\]\.topic: is required"):
            stash_many([{"key": "a"}])


def test_stash_many_keeps_order_across_batches():
    records = [{"topic": "orders", "key": f"k{i % 7}", "value": str(i)} for i in range(2500)]
    with transaction.atomic():
        ids = stash_many(records)
    assert ids == sorted(ids) and len(set(ids)) == 2500
    values = list(OutboxRecord.objects.order_by("id").values_list("kafka_value", flat=True))
    assert values == [str(i) for i in range(2500)]


def test_headers_and_tombstones_round_trip():
    with transaction.atomic():
        stash("orders", "k1", None, [("trace", "a"), ("trace", "b"), ("kind", "ünïcode")])
        stash("orders", "k2", b"bytes \xc3\xa9", {"content-type": "application/json"})
        stash("orders", "k3", {"amount": 12, "tags": ["x"]})
        stash("orders", "k4", "", [])
    rows = list(OutboxRecord.objects.order_by("id"))
    assert rows[0].kafka_value is None
    assert rows[0].headers == [("trace", "a"), ("trace", "b"), ("kind", "ünïcode")]
    assert rows[1].kafka_value == "bytes é"
    assert rows[1].headers == [("content-type", "application/json")]
    assert json.loads(rows[2].kafka_value) == {"amount": 12, "tags": ["x"]}
    assert rows[3].kafka_value == "" and rows[3].headers == []
    assert all(row.create_time is not None and row.leader_id is None for row in rows)


def test_goharvest_style_sql_insert_is_readable_through_the_model():
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO outbox (create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, "
            "kafka_header_values) VALUES (NOW(), %s, %s, %s, %s, %s)",
            ["my-app.topic", "hello", "world", ["applicationId"], ["my-app"]],
        )
    record = OutboxRecord.objects.get()
    assert (record.kafka_topic, record.kafka_key, record.kafka_value) == ("my-app.topic", "hello", "world")
    assert record.headers == [("applicationId", "my-app")]


def test_unpaired_header_arrays_are_rejected_by_the_table():
    from django.db import IntegrityError

    with pytest.raises(IntegrityError), connection.cursor() as cursor:
        cursor.execute("INSERT INTO outbox (kafka_topic, kafka_key, kafka_header_keys, kafka_header_values) "
                       "VALUES ('t', 'k', ARRAY['a','b'], ARRAY['a'])")


def test_notify_is_delivered_on_commit_only(database_url):
    with psycopg.connect(database_url, autocommit=True) as listener:
        oid = listener.execute("SELECT 'outbox'::regclass::oid::bigint").fetchone()[0]
        listener.execute(f'LISTEN "{notify_channel(oid)}"')

        def notified(timeout: float) -> bool:
            ready, _, _ = select.select([listener.fileno()], [], [], timeout)
            return bool(ready) and bool(list(listener.notifies(timeout=0.01, stop_after=1)))

        with pytest.raises(RuntimeError), transaction.atomic():
            stash("orders", "rolled-back")
            raise RuntimeError
        assert not notified(0.3)
        with transaction.atomic():
            stash("orders", "k1")
            assert not notified(0.2)
        assert notified(5)


def test_manage_py_check_passes():
    call_command("check", fail_level="WARNING")


def test_awkward_header_text_round_trips_through_the_batch_insert():
    awkward = ['a,b', '{braces}', 'quote " inside', "back\\slash", "NULL", "", " spaced ", "ünï", "\\\"mixed\\"]
    with transaction.atomic():
        stash_many([{"topic": "orders", "key": "k", "headers": [(f"h{i}", text) for i, text in enumerate(awkward)]},
                    {"topic": "orders", "key": "k", "headers": [(text or "empty", "v") for text in awkward]}])
    first, second = OutboxRecord.objects.order_by("id")
    assert [value for _, value in first.headers] == awkward
    assert [name for name, _ in second.headers] == [text or "empty" for text in awkward]
