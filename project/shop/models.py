"""A one-table shop: placing an order stashes an `orders` event and an `order-confirmations`
queue message in the same transaction; a queue handler confirms the order (project.shop.handlers)."""

from django.db import models


class Order(models.Model):
    item = models.CharField(max_length=100)
    quantity = models.PositiveIntegerField(default=1)
    created = models.DateTimeField(auto_now_add=True)
    #: Set by the order-confirmations handler (manage.py outbox_consume).
    confirmed = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        state = "confirmed" if self.confirmed else "awaiting confirmation"
        return f"order {self.pk}: {self.quantity} x {self.item} ({state})"
