"""Django admin: the outbox and its parked records, read-only; a dashboard; and actions that act
through the engine's SQL (outbox.console.operations). Every record state comes from outbox.states."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.functional import cached_property
from django.utils.html import format_html
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.timesince import timesince

from outbox import conf
from outbox.console import dashboard, history, operations, pages
from outbox.console.operations import Outcome
from outbox.models import Dashboard, DeadLetter, OutboxRecord
from outbox.states import COUNT_LIMIT, OUTBOX_STATES, Facts, RecordState, table_estimate

#: Topics offered by the topic filter are read from this many of the oldest rows.
TOPIC_SAMPLE_ROWS = 10_000
#: A record's page shows at most this many characters of its value (a poison value may be a megabyte).
VALUE_SHOWN = 10_000
#: An action acts on at most this many of the selected records.
ACTION_LIMIT = 1000


def facts(request: HttpRequest) -> Facts:
    """The facts record states are decided from, read once per request."""
    if not hasattr(request, "_outbox_facts"):
        request._outbox_facts = Facts.read(conf.database_alias())
    return request._outbox_facts


class EstimatedCountPaginator(Paginator):
    """Never COUNT(*) a big table: Postgres's live-row estimate unfiltered, a bounded count otherwise."""

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if not queryset.query.where:
            estimate = table_estimate(queryset.model._meta.db_table, queryset.db)
            if estimate is not None and estimate > COUNT_LIMIT:
                return estimate
        return queryset[:COUNT_LIMIT + 1].count()


class TopicFilter(admin.SimpleListFilter):
    title = "topic"
    parameter_name = "topic"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        head = (model_admin.get_queryset(request).order_by("id").values_list("kafka_topic", flat=True)
                [:TOPIC_SAMPLE_ROWS])
        topics = sorted(set(head))
        chosen = self.value()
        if chosen and chosen not in topics:
            topics.append(chosen)
        return [(topic, topic) for topic in topics]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        return queryset.filter(kafka_topic=self.value()) if self.value() else queryset


class StateFilter(admin.SimpleListFilter):
    """The states of outbox.states (parked records have an admin of their own)."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(state.value, state.label) for state in OUTBOX_STATES]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        if self.value() in {state.value for state in OUTBOX_STATES}:
            return queryset.filter(facts(request).where(RecordState(self.value())))
        return queryset


@dataclass(frozen=True)
class Confirmation:
    """What a confirmation page asks."""

    action: str
    title: str
    explanation: str
    button: str


class ReadOnlyAdmin(pages.NotEditedHere, admin.ModelAdmin):
    """Rows written and removed by stash(), the harvester and the actions, never edited by hand."""

    paginator = EstimatedCountPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # a count per filter choice would scan a big table
    list_per_page = 50
    search_fields = ["=kafka_key"]
    search_help_text = "Exact key."

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        # The configured database; values are read only where shown (a poison value may be a megabyte).
        return super().get_queryset(request).using(conf.database_alias()).defer("kafka_value")

    @admin.display(description="value")
    def value(self, record: Any) -> str:
        value = record.kafka_value
        if value is None:
            return "(none: a tombstone)"
        if len(value) <= VALUE_SHOWN:
            return value
        return f"{value[:VALUE_SHOWN]}... (the first {VALUE_SHOWN:,} of {len(value):,} characters)"

    @admin.display(description="headers")
    def header_table(self, record: Any) -> str:
        return pages.header_table(record.headers)

    def confirm_then(self, request: HttpRequest, queryset: QuerySet, ask: Confirmation,
                     run: Callable[[list[Any]], Outcome]) -> HttpResponse | None:
        """Ask first (a page listing the records); once confirmed, run the action and say what it did."""
        records = list(queryset.order_by("id")[:ACTION_LIMIT])
        back = request.POST.get("next", "")
        if not url_has_allowed_host_and_scheme(back, allowed_hosts={request.get_host()},
                                               require_https=request.is_secure()):
            back = ""
        if request.POST.get("post") != "yes":
            context = {**self.admin_site.each_context(request), "title": ask.title, "ask": ask,
                       "rows": [(record, self.describe(request, record)) for record in records],
                       "opts": self.model._meta, "next": back,
                       "action_checkbox_name": admin.helpers.ACTION_CHECKBOX_NAME}
            return TemplateResponse(request, "admin/outbox/action_confirmation.html", context)
        outcome = run(records)
        self.message_user(request, outcome.message(), outcome.level)
        return HttpResponseRedirect(back) if back else None

    def describe(self, request: HttpRequest, record: Any) -> str:
        """One line about a record on a confirmation page."""
        return ""


@admin.register(OutboxRecord)
class OutboxRecordAdmin(ReadOnlyAdmin):
    list_display = ["id", "kafka_topic", "kafka_key", "state", "age", "reset_count", "short_error"]
    list_filter = [StateFilter, TopicFilter]
    ordering = ["id"]
    actions = ["retry_selected", "park_selected", "requeue_selected", "delete_selected"]
    fields = ["id", "state", "why", "create_time", "kafka_topic", "kafka_key", "value", "header_table", "leader_id",
              "reset_count", "last_error"]
    readonly_fields = fields

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """Requeue, retry and park change what gets published, and when: as powerful as deleting."""
        return request.user.has_perm("outbox.delete_outboxrecord")

    has_requeue_permission = has_retry_permission = has_park_permission = has_operate_permission

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        changelist = super().get_changelist_instance(request)
        for record in changelist.result_list:
            record.verdict = facts(request).state_of(record)
        return changelist

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Any:
        record = super().get_object(request, object_id, from_field)
        if record is not None:
            record.verdict = facts(request).state_of(record)
        return record

    def describe(self, request: HttpRequest, record: OutboxRecord) -> str:
        return facts(request).state_of(record).label

    def log_done(self, request: HttpRequest, records: list[OutboxRecord], outcome: Outcome, message: str) -> Outcome:
        """One admin log entry per record the action changed."""
        for record in records:
            if record.id in outcome.done:
                self.log_change(request, record, message)
        return outcome

    @admin.display(description="state")
    def state(self, record: OutboxRecord) -> str:
        verdict = record.verdict
        return format_html('<span class="outbox-state outbox-state-{}" title="{}">{}</span>', verdict.state.value,
                           verdict.why, verdict.label)

    @admin.display(description="why")
    def why(self, record: OutboxRecord) -> str:
        return record.verdict.why

    @admin.display(description="age")
    def age(self, record: OutboxRecord) -> str:
        return timesince(record.create_time)

    @admin.display(description="last error")
    def short_error(self, record: OutboxRecord) -> str:
        return pages.shortened(record.last_error or "")

    @admin.action(description="Retry selected held records now", permissions=["retry"])
    def retry_selected(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        ask = Confirmation("retry_selected", "Retry held records now?", (
            "The leader sends each held record again at once, alone. If it fails again it stays held, and the "
            "records of its key keep waiting behind it. Fix its value first if that is what is wrong. Records "
            "that are not held are left alone."), "Yes, retry now")

        def run(records: list[OutboxRecord]) -> Outcome:
            outcome = operations.retry_now([r.id for r in records], facts(request), request.user.get_username())
            return self.log_done(request, records, outcome, "Retry now: the leader sends it again, alone.")
        return self.confirm_then(request, queryset, ask, run)

    @admin.action(description="Park selected held records", permissions=["park"])
    def park_selected(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        topic = conf.setting("dead_letter_topic")
        ask = Confirmation("park_selected", "Park held records?", (
            "Each held record moves to the dead-letter table (Parked records), and the records of its key "
            "waiting behind it are published without it: its key's order is broken at that record. "
            + (f"It is also published to the dead-letter topic {topic}. " if topic else "")
            + "Republishing it later puts it back in the outbox after its key's later records. Records that are "
              "not held are left alone."), "Yes, park")

        def run(records: list[OutboxRecord]) -> Outcome:
            outcome, parked = operations.park([r.id for r in records], facts(request), request.user.get_username())
            dead_letters = DeadLetter.objects.using(conf.database_alias()).in_bulk([p.dead_letter_id for p in parked])
            dead_letter_admin = self.admin_site._registry.get(DeadLetter)
            for moved in parked:
                dead_letter_admin.log_addition(request, dead_letters[moved.dead_letter_id],
                                               f"Parked outbox record #{moved.outbox_id} (it was held).")
            return outcome
        return self.confirm_then(request, queryset, ask, run)

    @admin.action(description="Requeue selected outbox records", permissions=["requeue"])
    def requeue_selected(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        ask = Confirmation("requeue_selected", "Requeue outbox records?", (
            "Their leader id and failure count are cleared, so the leader marks and publishes them again. "
            "Records marked by the live leader are left alone: they may be in flight, and held records are "
            "retried or parked instead."), "Yes, requeue")

        def run(records: list[OutboxRecord]) -> Outcome:
            outcome = operations.requeue([r.id for r in records], facts(request))
            return self.log_done(request, records, outcome, "Requeued: leader_id and failure count cleared.")
        return self.confirm_then(request, queryset, ask, run)


@admin.register(DeadLetter)
class DeadLetterAdmin(ReadOnlyAdmin):
    """Parked records: moved out of the outbox so the records of their key behind them could go on."""

    list_display = ["outbox_id", "kafka_topic", "kafka_key", "short_reason", "attempts", "parked_at", "parked_by",
                    "dead_letter_topic"]
    list_display_links = ["outbox_id"]
    ordering = ["-parked_at", "-id"]
    actions = ["republish_selected", "delete_selected"]
    fields = ["id", "outbox_id", "create_time", "kafka_topic", "kafka_key", "value", "header_table", "reason",
              "attempts", "parked_at", "parked_by", "dead_letter_topic"]
    readonly_fields = fields

    def has_republish_permission(self, request: HttpRequest) -> bool:
        """Republishing removes the parked record and adds an outbox record."""
        return (request.user.has_perm("outbox.delete_deadletter")
                and request.user.has_perm("outbox.add_outboxrecord"))

    @admin.display(description="reason")
    def short_reason(self, record: DeadLetter) -> str:
        return pages.shortened(record.reason)

    def describe(self, request: HttpRequest, record: DeadLetter) -> str:
        return f"was outbox record #{record.outbox_id}: {record.reason}"

    @admin.action(description="Republish selected parked records", permissions=["republish"])
    def republish_selected(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        ask = Confirmation("republish_selected", "Republish parked records?", (
            "Each record goes back into the outbox with a new id and is removed from here. It is then published "
            "AFTER the records of its key written since it was first stashed, not in its old place: consumers of "
            "its key see it out of its original order. If what made it fail has not been fixed, it is held "
            "again."), "Yes, republish")

        def run(records: list[DeadLetter]) -> Outcome:
            outcome, done = operations.republish([r.id for r in records])
            records_admin = self.admin_site._registry.get(OutboxRecord)
            for moved in done:
                dead = moved.dead_letter
                record = OutboxRecord(id=moved.new_id, kafka_topic=dead.kafka_topic, kafka_key=dead.kafka_key)
                records_admin.log_addition(request, record, f"Republished parked record #{dead.id} (outbox record "
                                                            f"#{dead.outbox_id}) as #{moved.new_id}.")
            return outcome
        return self.confirm_then(request, queryset, ask, run)


@admin.register(Dashboard)
class DashboardAdmin(pages.ConsolePage, admin.ModelAdmin):
    """/admin/outbox/dashboard/: who leads, the backlog, held, parked and stuck records."""

    #: The dashboard lists record keys, topics, errors and in-flight keys: it takes the records' view permission.
    view_permission_of = OutboxRecord

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        using = conf.database_alias()
        found = dashboard.overview(using)
        bar = pages.toolbar(request)
        records_admin = self.admin_site._registry[OutboxRecord]
        parked_admin = self.admin_site._registry[DeadLetter]
        context = {
            **self.admin_site.each_context(request),
            **bar,
            "title": "Outbox dashboard",
            "opts": self.model._meta,
            "overview": found,
            "history": history.read(bar["span"], using),
            "history_interval": conf.setting("history_interval"),
            "head_rows": dashboard.HEAD_ROWS,
            "here": request.get_full_path(),
            "replicas": found.replicas,
            "gone_after": conf.setting("status_gone_after"),
            "can_operate": records_admin.has_operate_permission(request),
            "can_delete": records_admin.has_delete_permission(request),
            "parked_url": (reverse("admin:outbox_deadletter_changelist")
                           if parked_admin.has_view_permission(request) else None),
            "action_checkbox_name": admin.helpers.ACTION_CHECKBOX_NAME,
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/outbox/dashboard.html", context)
