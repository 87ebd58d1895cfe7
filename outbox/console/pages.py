"""What the console pages (the outbox dashboard, the queue pages) and the admin's tables share: the
auto-refresh choices and the span of their charts (read from the page's address so a reload or a bookmark
keeps them), who may see a page, and how a long text or a header list is shown."""

from __future__ import annotations

from typing import Any

from django.db.models import Model
from django.http import HttpRequest
from django.utils.html import format_html_join

from outbox.console import history

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


def shortened(text: str, limit: int = 60) -> str:
    """A long error, reason or payload cut for a list column."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def header_table(headers: Any) -> str:
    """A record's or a message's headers, one line each, in their order (repeats kept)."""
    if not headers:
        return "(none)"
    return format_html_join("", "<div><code>{}</code>: <code>{}</code></div>", headers)


class NotEditedHere:
    """Rows that stash(), the harvester and the trackers write: never added or edited in the admin."""

    class Media:
        css = {"all": ["outbox/admin.css"]}  # long values wrap

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ConsolePage(NotEditedHere):
    """A model admin that is a page of the console (the dashboard, the queues), not a table: nothing to add,
    change or delete, and seen by whoever may view the rows it shows (`view_permission_of`'s view
    permission, view or change as Django's own), whatever their staff status."""

    view_permission_of: type[Model]
    admin_site: Any

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return bool(self.admin_site._registry[self.view_permission_of].has_view_permission(request))

    def has_module_permission(self, request: HttpRequest) -> bool:
        return self.has_view_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
