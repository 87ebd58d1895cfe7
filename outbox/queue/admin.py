"""Django admin: a page per queue (in progress, oldest, redeliveries, dead letters, live consumers and
trackers) and the dead letters, read-only, with requeue and delete actions."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import path

from outbox.console import pages
from outbox.queue import api, app_settings, history, overview
from outbox.queue.config import QUEUE_NAME_PATTERN
from outbox.queue.errors import QueueError
from outbox.queue.models import DeadLetter, Queue

#: Dead letters listed on a queue's page (the changelist has them all).
RECENT_DEAD_LETTERS = 20


@admin.register(Queue)
class QueueAdmin(pages.ConsolePage, admin.ModelAdmin):
    """/admin/outbox_queue/queue/: every queue; /admin/outbox_queue/queue/<name>/: one queue."""

    #: The queue pages show dead letters' payloads and what the consumers hold: dead letters' view permission.
    view_permission_of = DeadLetter

    def get_urls(self) -> list[Any]:
        detail = path("<str:name>/", self.admin_site.admin_view(self.queue_view), name="outbox_queue_queue_detail")
        return [detail, *super().get_urls()]

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        found = overview.processes()
        context = self._context(request, "Queues")
        summaries = overview.queues(found)
        context.update({"queues": summaries, "processes": found,
                        "markers_queues": not summaries or any(q.backend != "share" for q in summaries),
                        "share_queues": any(q.backend == "share" for q in summaries),
                        "charts": history.read(context["span"]).overview_charts(), **(extra_context or {})})
        return TemplateResponse(request, "admin/outbox_queue/queues.html", context)

    def queue_view(self, request: HttpRequest, name: str) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        if not QUEUE_NAME_PATTERN.fullmatch(name):
            raise Http404("not a queue name")
        config = app_settings.queue_config()
        context = self._context(request, f"Queue {name}")
        context.update({
            "queue": overview.queue(name),
            "charts": history.read(context["span"], queue=name).charts_of(name),
            "limits": config.limits_for(name),
            "config": config,
            "share_topic": config.share_topic(name),
            "share_group": config.share_group(name),
            "dead_letters": DeadLetter.objects.filter(queue=name).order_by("-id")[:RECENT_DEAD_LETTERS],
        })
        return TemplateResponse(request, "admin/outbox_queue/queue.html", context)

    def _context(self, request: HttpRequest, title: str) -> dict[str, Any]:
        return {**self.admin_site.each_context(request), **pages.toolbar(request), "title": title,
                "opts": self.model._meta, "gone_after": app_settings.setting("status_gone_after"),
                "history_interval": app_settings.setting("history_interval")}


@admin.register(DeadLetter)
class DeadLetterAdmin(pages.NotEditedHere, admin.ModelAdmin):
    """Read-only: dead letters are written by trackers; requeue sends one back to its queue with the same id."""

    list_display = ["id", "queue", "message_id", "deliveries", "last_delivered", "created", "preview"]
    list_filter = ["queue"]
    search_fields = ["=message_id"]
    search_help_text = "Exact message id."
    list_per_page = 50
    actions = ["requeue_selected", "delete_selected"]
    fields = ["id", "queue", "message_id", "deliveries", "last_delivered", "created", "text", "header_table"]
    readonly_fields = fields

    def has_requeue_permission(self, request: HttpRequest) -> bool:
        """Requeueing removes the row, so it takes the delete permission."""
        return request.user.has_perm("outbox_queue.delete_deadletter")

    @admin.display(description="payload")
    def preview(self, letter: DeadLetter) -> str:
        return pages.shortened(letter.text)

    @admin.display(description="payload")
    def text(self, letter: DeadLetter) -> str:
        return letter.text

    @admin.display(description="headers")
    def header_table(self, letter: DeadLetter) -> str:
        return pages.header_table(letter.headers)

    @admin.action(description="Requeue selected dead letters", permissions=["requeue"])
    def requeue_selected(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        """Send each back to its queue (same id, deliveries counted from 1) and delete its row; asks first."""
        letters = list(queryset.order_by("id")[:1000])
        if request.POST.get("post") != "yes":
            context = {**self.admin_site.each_context(request), "title": "Requeue dead letters?", "letters": letters,
                       "opts": self.model._meta, "action_checkbox_name": admin.helpers.ACTION_CHECKBOX_NAME}
            return TemplateResponse(request, "admin/outbox_queue/requeue_confirmation.html", context)
        for done, letter in enumerate(letters):
            try:
                api.requeue(letter)
            except QueueError as error:
                self.message_user(request, f"Stopped after {done} requeued: {error}", messages.ERROR)
                return None
            # Logged as a change with the reason, then removed: the message is back in its queue.
            self.log_change(request, letter, f"Requeued to queue {letter.queue}; the dead letter was removed.")
            letter.delete()
        self.message_user(request, f"Requeued {len(letters)} dead letter(s).", messages.SUCCESS)
        return None
