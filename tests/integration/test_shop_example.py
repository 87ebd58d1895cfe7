"""The example shop's own tests, written as a user of the package writes theirs: with outbox.testing, under
pytest-django's `db` fixture, with no Kafka."""

from __future__ import annotations

import pytest

from outbox.testing import assert_stashed, capture_stashed, handle_message, harvest
from project.shop.handlers import confirm_order
from project.shop.models import Order

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


def test_placing_an_order_stashes_its_event_and_its_confirmation_in_its_transaction(client):
    with capture_stashed() as records:
        client.post("/", {"item": "book", "quantity": 2})
    order = Order.objects.get()
    assert_stashed("orders", key=str(order.pk), value={"id": order.pk, "item": "book", "quantity": 2,
                                                       "event": "placed"}, records=records, count=1)
    [confirmation] = [r for r in records if r.topic != "orders"]
    assert confirmation.json() == {"order": order.pk}


def test_the_harvest_publishes_the_order_and_the_confirmation_is_handled_once():
    from django.test import Client

    Client().post("/", {"item": "pen", "quantity": 1})
    order = Order.objects.get()
    published = harvest()
    [placed] = [m for m in published if m.topic == "orders"]
    [message] = [m for m in published if m.topic != "orders"]
    assert placed.json()["event"] == "placed" and message.json() == {"order": order.pk}
    first = handle_message(confirm_order, message.json(), queue="order-confirmations", inbox=True)
    again = handle_message(confirm_order, message.json(), queue="order-confirmations", inbox=True,
                           message_id=first.message.id, deliveries=2)
    assert (first.outcome, again.outcome) == ("handled", "skipped")
    order.refresh_from_db()
    assert order.confirmed is not None
