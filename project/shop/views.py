from django import forms
from django.db import transaction
from django.shortcuts import redirect, render

from outbox import queue, stash
from outbox.models import OutboxRecord
from project.shop.models import Order


class OrderForm(forms.ModelForm):
    class Meta:
        model = Order
        fields = ["item", "quantity"]


def orders(request):
    """Place an order; its event is written to the outbox in the order's own transaction."""
    form = OrderForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        with transaction.atomic():
            order = form.save()
            stash("orders", key=str(order.pk), value={"id": order.pk, "item": order.item,
                                                      "quantity": order.quantity, "event": "placed"})
            # Work for a queue consumer, sent if and only if the order commits.
            queue.stash("order-confirmations", {"order": order.pk})
        return redirect("orders")
    context = {
        "form": form,
        "orders": Order.objects.order_by("-id")[:10],
        "pending": OutboxRecord.objects.order_by("id")[:10],
    }
    return render(request, "shop/orders.html", context)
