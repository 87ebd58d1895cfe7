"""Django admin: a read-only view of the outbox, a dashboard, and actions that act through the engine's SQL."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.paginator import Paginator
from django.db import connections, transaction
from django.db.models import Case, Q, QuerySet, Value, When
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html_join
from django.utils.timesince import timesince

from outbox import conf, dashboard
from outbox.harvest.store import requeue
from outbox.models import Dashboard, OutboxRecord

#: Topics offered by the topic filter are read from this many of the oldest rows.
TOPIC_SAMPLE_ROWS = 10_000
#: Filtered changelists count at most this many rows ("10,000+" beyond).
COUNT_LIMIT = 10_000


class EstimatedCountPaginator(Paginator):
    """Never COUNT(*) a big outbox: Postgres's live-row estimate unfiltered, a bounded count otherwise."""

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if not queryset.query.where:
            with connections[queryset.db].cursor() as cursor:
                cursor.execute("SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = to_regclass(%s)",
                               [queryset.model._meta.db_table])
                row = cursor.fetchone()
            if row is not None and row[0] > COUNT_LIMIT:
                return int(row[0])
        return queryset[:COUNT_LIMIT + 1].count()


class TopicFilter(admin.SimpleListFilter):
    title = "topic"
    parameter_name = "topic"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        head = OutboxRecord.objects.order_by("id").values_list("kafka_topic", flat=True)[:TOPIC_SAMPLE_ROWS]
        topics = sorted(set(head))
        chosen = self.value()
        if chosen and chosen not in topics:
            topics.append(chosen)
        return [(topic, topic) for topic in topics]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        return queryset.filter(kafka_topic=self.value()) if self.value() else queryset


class StateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("pending", "pending"), ("in_flight", "in flight"), ("stuck", "stuck")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        live = dashboard.replicas().live_leader_ids
        not_live = Q(leader_id__isnull=False) & ~Q(leader_id__in=live)
        if self.value() == "pending":
            return queryset.filter(Q(leader_id__isnull=True) | not_live)
        if self.value() == "in_flight":
            return queryset.filter(leader_id__in=live)
        if self.value() == "stuck":
            old = timezone.now() - timezone.timedelta(seconds=conf.setting("stuck_after"))
            return queryset.filter(not_live | Q(create_time__lt=old)
                                   | Q(reset_count__gt=0, reset_count__gte=conf.setting("stuck_reset_count")))
        return queryset


@admin.register(OutboxRecord)
class OutboxRecordAdmin(admin.ModelAdmin):
    """Read-only: records are written by stash() and removed by the harvester, not edited here."""

    list_display = ["id", "kafka_topic", "kafka_key", "state", "age", "reset_count", "short_error"]
    list_filter = [StateFilter, TopicFilter]
    search_fields = ["=kafka_key"]
    search_help_text = "Exact key."
    ordering = ["id"]
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    list_per_page = 50
    actions = ["requeue_selected", "delete_selected"]
    fields = ["id", "create_time", "kafka_topic", "kafka_key", "value", "header_table", "leader_id", "reset_count",
              "last_error"]
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_requeue_permission(self, request: HttpRequest) -> bool:
        """Requeueing changes what gets published: as powerful as deleting."""
        return request.user.has_perm("outbox.delete_outboxrecord")

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        # Whether a row's leader is live, computed per request (a ModelAdmin is shared by all requests).
        live = dashboard.replicas().live_leader_ids
        return super().get_queryset(request).annotate(
            leader_live=Case(When(leader_id__in=live, then=Value(True)), default=Value(False)))

    @admin.display(description="state")
    def state(self, record: OutboxRecord) -> str:
        if record.leader_id is None:
            return "pending" if not record.reset_count else f"pending (failed {record.reset_count}x)"
        return "in flight" if record.leader_live else "marked by a gone leader"

    @admin.display(description="age")
    def age(self, record: OutboxRecord) -> str:
        return timesince(record.create_time)

    @admin.display(description="last error")
    def short_error(self, record: OutboxRecord) -> str:
        error = record.last_error or ""
        return error if len(error) <= 60 else error[:57] + "..."

    @admin.display(description="value")
    def value(self, record: OutboxRecord) -> str:
        return "(none: a tombstone)" if record.kafka_value is None else record.kafka_value

    @admin.display(description="headers")
    def header_table(self, record: OutboxRecord) -> str:
        if not record.headers:
            return "(none)"
        return format_html_join("", "<div><code>{}</code>: <code>{}</code></div>", record.headers)

    @admin.action(description="Requeue selected outbox records", permissions=["requeue"])
    def requeue_selected(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        """Clear leader_id (and the failure count) so the next mark picks the rows up; asks first."""
        records = list(queryset.order_by("id")[:1000])
        if request.POST.get("post") != "yes":
            context = {**self.admin_site.each_context(request), "title": "Requeue outbox records?",
                       "records": records, "opts": self.model._meta, "queryset": queryset,
                       "action_checkbox_name": admin.helpers.ACTION_CHECKBOX_NAME}
            return TemplateResponse(request, "admin/outbox/outboxrecord/requeue_confirmation.html", context)
        live = dashboard.replicas().live_leader_ids
        ids = [r.id for r in records]
        with transaction.atomic(using=queryset.db):
            requeued_ids = set(OutboxRecord.objects.using(queryset.db).filter(id__in=ids)
                               .filter(Q(leader_id__isnull=True) | ~Q(leader_id__in=live))
                               .values_list("id", flat=True))
            count = requeue(connections[queryset.db].connection, OutboxRecord._meta.db_table, ids, live)
            for record in records:
                if record.id in requeued_ids:
                    self.log_change(request, record, "Requeued: leader_id and failure count cleared.")
        skipped = len(ids) - count
        self.message_user(request, f"Requeued {count} outbox record(s).", messages.SUCCESS)
        if skipped:
            self.message_user(request, f"Skipped {skipped} record(s) marked by a live leader: they may be in flight.",
                              messages.WARNING)
        return None


@admin.register(Dashboard)
class DashboardAdmin(admin.ModelAdmin):
    """/admin/outbox/dashboard/: who leads, the backlog, in-flight keys and stuck records."""

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.is_active and request.user.is_staff

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        found = dashboard.replicas()
        records_admin = self.admin_site._registry[OutboxRecord]
        context = {
            **self.admin_site.each_context(request),
            "title": "Outbox dashboard",
            "opts": self.model._meta,
            "replicas": found,
            "warnings": dashboard.warnings(found),
            "backlog": dashboard.backlog(found),
            "stuck": dashboard.stuck_records(found),
            "gone_after": conf.setting("status_gone_after"),
            "can_requeue": records_admin.has_requeue_permission(request),
            "can_delete": records_admin.has_delete_permission(request),
            "action_checkbox_name": admin.helpers.ACTION_CHECKBOX_NAME,
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/outbox/dashboard.html", context)
