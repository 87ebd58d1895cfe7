"""A one-table shop: placing an order stashes an `orders` event in the same transaction."""

from django.db import models


class Order(models.Model):
    item = models.CharField(max_length=100)
    quantity = models.PositiveIntegerField(default=1)
    created = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"order {self.pk}: {self.quantity} x {self.item}"
