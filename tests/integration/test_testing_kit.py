"""outbox.testing as users meet it in their own suites: the records their code stashed, assertions on them, and
OutsideTransaction raised under the test framework's own transaction as it is in production."""

from __future__ import annotations

import pytest
from django.db import transaction
from django.test import TestCase, TransactionTestCase

from outbox import OutsideTransaction, stash, stash_many
from outbox.testing import ANY, assert_stashed, capture_stashed, stashed

pytestmark = pytest.mark.integration


def forgetful_view() -> None:
    """A view that forgot transaction.atomic()."""
    stash("orders", key="42", value={"status": "paid"})


def careful_view() -> None:
    with transaction.atomic():
        stash("orders", key="42", value={"status": "paid"}, headers={"source": "shop"})
        stash_many([{"topic": "audit", "key": "42", "value": "paid"}])


@pytest.mark.django_db
def test_under_the_db_fixture_a_forgotten_atomic_raises_as_in_production():
    with pytest.raises(OutsideTransaction, match=r"^stash\(\) must run inside transaction.atomic\(\)"):
        forgetful_view()
    with pytest.raises(OutsideTransaction, match=r"^stash_many\(\) must run inside"):
        stash_many([{"topic": "orders", "key": "1"}])
    assert stashed() == [], "nothing was written"


@pytest.mark.django_db
def test_records_stashed_in_a_block_are_captured_decoded_and_asserted_on():
    stash_before = None
    with transaction.atomic():
        stash_before = stash("orders", key="0", value="before")
    with capture_stashed() as records:
        careful_view()
    assert [(r.topic, r.key) for r in records] == [("orders", "42"), ("audit", "42")]
    assert records[0].json() == {"status": "paid"} and records[0].header("source") == "shop"
    assert records[0].id > stash_before
    assert_stashed("orders", key="42", value={"status": "paid"}, headers={"source": "shop"}, records=records)
    assert_stashed("audit", value="paid", records=records, count=1)
    assert len(assert_stashed("orders", key=ANY)) == 2, "without records=, every record in the outbox"
    with pytest.raises(AssertionError) as failed:
        assert_stashed("orders", key="43", records=records)
    assert str(failed.value).startswith("expected a record(s) of topic 'orders' with key '43', found 0 among the 2 "
                                        "stashed:\n  #")
    assert "'42': '{\"status\":\"paid\"}'" in str(failed.value)


@pytest.mark.django_db(transaction=True)
def test_under_transactional_db_the_same_works_on_committed_rows():
    with pytest.raises(OutsideTransaction):
        forgetful_view()
    with capture_stashed(topic="orders") as records:
        careful_view()
    assert [r.key for r in records] == ["42"]


@pytest.mark.django_db
def test_the_setting_lets_the_test_frameworks_atomic_count(settings):
    settings.OUTBOX = {**settings.OUTBOX, "tests_require_atomic": False}
    forgetful_view()
    assert_stashed("orders", key="42")


def test_the_pytest_plugin_gives_the_fixture(outbox_stashed):
    with outbox_stashed() as records:
        careful_view()
    assert len(records) == 2


class TestCaseUsers(TestCase):
    """Django's TestCase (its class-wide and per-test atomic blocks) behaves the same."""

    def test_a_forgotten_atomic_raises(self):
        with self.assertRaises(OutsideTransaction):
            forgetful_view()

    def test_inside_atomic_is_captured(self):
        with capture_stashed() as records:
            careful_view()
        self.assertEqual(len(records), 2)


class TransactionTestCaseUsers(TransactionTestCase):
    def test_a_forgotten_atomic_raises(self):
        with self.assertRaises(OutsideTransaction):
            forgetful_view()


@pytest.mark.django_db
def test_a_harvest_in_the_test_publishes_what_was_stashed_with_the_real_engine():
    from outbox.testing import harvest

    careful_view()
    with transaction.atomic():
        stash_many([{"topic": "orders", "key": "42", "value": "shipped"},
                    {"topic": "orders", "key": "7", "value": None}])
    published = harvest()
    assert sorted(((m.topic, m.key, m.value) for m in published), key=lambda t: t[:2]) == [
        ("audit", "42", "paid"), ("orders", "42", '{"status":"paid"}'), ("orders", "42", "shipped"),
        ("orders", "7", None)]
    paid, shipped = [m for m in published if (m.topic, m.key) == ("orders", "42")]
    assert (paid.json(), shipped.value) == ({"status": "paid"}, "shipped"), "a key's records in id order"
    assert paid.outbox_id < shipped.outbox_id and paid.header("source") == "shop"
    assert paid.header("outbox-create-time")
    assert stashed() == [], "the harvest purged what it published"
    assert harvest() == [], "nothing left"


@pytest.mark.django_db(transaction=True)
def test_a_harvest_under_transactional_db_reads_committed_rows():
    from outbox.testing import harvest

    careful_view()
    assert [m.topic for m in harvest()] == ["audit", "orders"]


def test_the_pytest_plugin_gives_a_harvest(outbox_harvest):
    careful_view()
    assert sorted(m.topic for m in outbox_harvest()) == ["audit", "orders"]


def test_what_queue_send_would_publish_is_captured_without_kafka():
    from outbox import InvalidRecord, queue
    from outbox.testing import capture_sent

    with capture_sent("emails") as sent:
        message_id = queue.send("emails", {"to": "a@example.com"}, headers={"lang": "en"})
        queue.send_many("reports", ["ignored: another queue"])
    assert [(m.queue, m.id, m.json()) for m in sent] == [("emails", message_id, {"to": "a@example.com"})]
    assert ("lang", "en") in sent[0].headers
    with capture_sent() as sent, pytest.raises(InvalidRecord, match=r"^payload: is not serialisable as JSON"):
        queue.send("emails", {"to": object()})  # not JSON: refused as send() refuses it, nothing recorded
    assert sent == []


@pytest.mark.django_db
def test_a_handler_runs_as_outbox_consume_runs_it_with_the_inbox():
    from outbox.queue.errors import Retry
    from outbox.testing import handle_message
    from project.shop.models import Order

    def create_order(message):
        Order.objects.create(item=message.json()["item"])

    first = handle_message(create_order, {"item": "book"}, queue="orders", inbox=True)
    again = handle_message(create_order, {"item": "book"}, queue="orders", inbox=True, message_id=first.message.id,
                           deliveries=2)
    assert (first.outcome, first.settled, again.outcome, again.settled) == ("handled", "acked", "skipped", "acked")
    assert Order.objects.filter(item="book").count() == 1, "effects once"

    def not_now(message):
        raise Retry("busy", delay=5)

    def broken(message):
        raise RuntimeError("boom")

    assert (handle_message(not_now, "x", queue="orders").settled,
            handle_message(not_now, "x", queue="orders").retry_delay) == ("retried", 5)
    failed = handle_message(broken, "x", queue="orders")
    assert (failed.outcome, failed.settled) == ("failed", "abandoned")
