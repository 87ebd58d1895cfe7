"""What the console pages (the outbox dashboard, the queue pages) share: the auto-refresh choices and the
span of their charts, both read from the page's address so a reload or a bookmark keeps them."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest

from outbox import history

#: Auto-refresh intervals offered, in seconds (0: off, the default).
REFRESH_CHOICES = [(0, "off"), (5, "every 5 s"), (15, "every 15 s"), (60, "every minute")]


def refresh_seconds(request: HttpRequest) -> int:
    """?refresh=N when N is one of the choices, else 0 (off)."""
    try:
        value = int(request.GET.get("refresh", "0"))
    except ValueError:
        return 0
    return value if value in dict(REFRESH_CHOICES) else 0


def toolbar(request: HttpRequest, with_spans: bool = True) -> dict[str, Any]:
    """The toolbar's context: the chosen span and refresh, and the choices."""
    span = history.span_of(request.GET.get("span"))
    return {"span": span, "span_label": history.SPAN_LABELS[span], "refresh": refresh_seconds(request),
            "refresh_choices": REFRESH_CHOICES,
            "spans": [(value, f"last {label}") for value, label in history.SPAN_LABELS.items()] if with_spans else []}
