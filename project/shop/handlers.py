"""Queue handlers of the example shop.

    manage.py outbox_consume --queue order-confirmations --handler project.shop.handlers.confirm_order --inbox
    manage.py outbox_redeliver
"""

from __future__ import annotations

import logging

from django.utils import timezone

from outbox.queue import Message
from project.shop.models import Order

log = logging.getLogger("outbox.queue.shop")


def confirm_order(message: Message) -> None:
    """Confirm the order named by the message (run with --inbox: once per message, even when redelivered)."""
    order_id = message.json()["order"]
    confirmed = Order.objects.filter(pk=order_id, confirmed__isnull=True).update(confirmed=timezone.now())
    log.info("Order %s %s (delivery %d of message %s)", order_id, "confirmed" if confirmed else "was confirmed before",
             message.deliveries, message.id)
