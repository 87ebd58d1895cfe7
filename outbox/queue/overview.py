"""What the admin's queue pages show, from the status rows of live consumers and trackers and the queue tables.

In progress and the oldest message in progress come from the trackers (they hold the state
rebuilt from the markers log), or for a share queue (no trackers) from its consumers' status rows;
redeliveries from the per-queue counters; dead letters from their table. A process not seen for
status_gone_after seconds is gone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from django.db.models import Count
from django.utils import timezone

from outbox.queue import app_settings
from outbox.queue.models import DeadLetter, QueueCounter, QueueProcess


@dataclass
class Processes:
    consumers: list[QueueProcess]
    trackers: list[QueueProcess]
    gone: list[QueueProcess]


@dataclass
class QueueSummary:
    name: str
    in_progress: int = 0
    oldest_started: datetime | None = None
    redelivered: int = 0
    dead_letters: int = 0
    consumers: list[QueueProcess] = field(default_factory=list)
    trackers: list[QueueProcess] = field(default_factory=list)
    #: "markers" or "share" (from settings): a share queue needs no tracker.
    backend: str = "markers"

    @property
    def needs_tracker(self) -> bool:
        """Markers queue with no live tracker reading it: its messages are not redelivered if a consumer dies."""
        return self.backend != "share" and not self.trackers

    @property
    def oldest_age(self) -> timedelta | None:
        return None if self.oldest_started is None else max(timedelta(0), timezone.now() - self.oldest_started)


def processes(now: datetime | None = None) -> Processes:
    now = now or timezone.now()
    gone_after = timedelta(seconds=app_settings.setting("status_gone_after"))
    rows = list(QueueProcess.objects.order_by("kind", "name"))
    live = [r for r in rows if now - r.last_seen <= gone_after]
    return Processes(consumers=[r for r in live if r.kind == "consumer"],
                     trackers=[r for r in live if r.kind == "tracker"],
                     gone=[r for r in rows if now - r.last_seen > gone_after])


def queues(found: Processes | None = None) -> list[QueueSummary]:
    """Every queue anyone knows of: consumed, tracked, counted, dead-lettered or configured; by name."""
    found = found or processes()
    summaries: dict[str, QueueSummary] = {}

    def summary(name: str) -> QueueSummary:
        return summaries.setdefault(name, QueueSummary(name))

    for consumer in found.consumers:
        summary(consumer.queue).consumers.append(consumer)
    for tracker in found.trackers:
        # A tracker reads the markers of the queues that hash to its partitions.
        for name in set(tracker.stats.get("markers") or {}) | set(tracker.stats.get("queues") or {}):
            summary(name).trackers.append(tracker)
        for name, stats in (tracker.stats.get("queues") or {}).items():
            item = summary(name)
            item.in_progress += int(stats.get("in_progress") or 0)
            started = stats.get("oldest_started")
            if started is not None:
                when = datetime.fromtimestamp(float(started), UTC)
                item.oldest_started = when if item.oldest_started is None else min(item.oldest_started, when)
    config = app_settings.queue_config()
    for name in config.per_queue:
        summary(name)
    for counter in QueueCounter.objects.all():
        summary(counter.queue).redelivered = counter.redelivered
    for row in DeadLetter.objects.values("queue").annotate(n=Count("id")):
        summary(row["queue"]).dead_letters = row["n"]
    for item in summaries.values():  # every queue found, those known by their counters or dead letters alone too
        item.backend = config.backend(item.name)
        if item.backend == "share":  # no trackers: what the share group's consumers hold
            item.in_progress = sum(consumer.in_progress for consumer in item.consumers)
            ages = [float(c.stats["oldest_in_progress_seconds"]) for c in item.consumers
                    if c.stats.get("oldest_in_progress_seconds") is not None]
            if ages:
                item.oldest_started = min(c.last_seen for c in item.consumers) - timedelta(seconds=max(ages))
    return [summaries[name] for name in sorted(summaries)]


def queue(name: str) -> QueueSummary:
    found = processes()
    for item in queues(found):
        if item.name == name:
            return item
    return QueueSummary(name, backend=app_settings.queue_config().backend(name))
