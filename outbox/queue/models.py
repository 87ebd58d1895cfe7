"""The queue app's tables: inbox rows, dead letters, status rows of consumers and trackers, counters."""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now

#: Longest queue name (config.QUEUE_NAME_PATTERN).
MAX_QUEUE_LENGTH = 200


class InboxEntry(models.Model):
    """A message whose handler's effects committed (`outbox_consume --inbox`): a redelivery is acked unrun."""

    queue = models.CharField(max_length=MAX_QUEUE_LENGTH)
    message_id = models.CharField(max_length=200)
    processed = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "outbox_queue_inbox"
        verbose_name = "inbox entry"
        verbose_name_plural = "inbox entries"
        constraints = [models.UniqueConstraint(fields=["queue", "message_id"], name="outbox_queue_inbox_uniq")]
        indexes = [models.Index(fields=["processed"], name="outbox_queue_inbox_processed")]

    def __str__(self) -> str:
        return f"{self.queue}/{self.message_id}"


class DeadLetter(models.Model):
    """A message delivered max_deliveries times without an ack; stored by a tracker instead of redelivered."""

    id = models.BigAutoField(primary_key=True)
    queue = models.CharField(max_length=MAX_QUEUE_LENGTH)
    message_id = models.CharField(max_length=200)
    key = models.BinaryField(null=True)
    payload = models.BinaryField(null=True)
    #: The message's own headers: [[name, value], ...] (values decoded as UTF-8).
    headers = models.JSONField(default=list)
    deliveries = models.IntegerField()
    #: When its last delivery started.
    last_delivered = models.DateTimeField()
    created = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "outbox_queue_dead_letter"
        verbose_name = "dead letter"
        ordering = ["-id"]
        constraints = [models.UniqueConstraint(fields=["queue", "message_id"], name="outbox_queue_dead_letter_uniq")]

    def __str__(self) -> str:
        return f"{self.queue}/{self.message_id}"

    @property
    def text(self) -> str:
        return bytes(self.payload or b"").decode("utf-8", "replace")


class QueueProcess(models.Model):
    """A running consumer (`outbox_consume`) or tracker (`outbox_redeliver`), upserted every status_interval."""

    KINDS = [("consumer", "consumer"), ("tracker", "tracker")]

    name = models.CharField(max_length=200, primary_key=True)
    kind = models.CharField(max_length=20, choices=KINDS)
    #: The consumer's queue; empty for a tracker (it serves every queue of its partitions).
    queue = models.CharField(max_length=MAX_QUEUE_LENGTH, blank=True)
    host = models.CharField(max_length=255)
    pid = models.IntegerField()
    started = models.DateTimeField()
    last_seen = models.DateTimeField()
    #: Consumer: messages held. Tracker: messages in progress over its partitions.
    in_progress = models.IntegerField(default=0)
    #: Consumer: received/acked/retried/... totals. Tracker: {"partitions": [...], "queues": {name: {...}}}.
    stats = models.JSONField(default=dict)

    class Meta:
        db_table = "outbox_queue_process"
        verbose_name = "queue process"
        ordering = ["kind", "name"]

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"


class QueueCounter(models.Model):
    """Redeliveries and dead letters per queue since the table was created, added to by the trackers."""

    queue = models.CharField(max_length=MAX_QUEUE_LENGTH, primary_key=True)
    redelivered = models.BigIntegerField(default=0)
    dead_lettered = models.BigIntegerField(default=0)
    updated = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "outbox_queue_counter"

    def __str__(self) -> str:
        return self.queue


class QueueSample(models.Model):
    """A tracker's figures for one queue at one moment, for the queue pages' charts: written with its status row
    every `history_interval` seconds (outbox.queue.status), deleted after `history_retention` seconds."""

    id = models.BigAutoField(primary_key=True)
    at = models.DateTimeField(db_default=Now())
    #: The tracker (its status row's name): each tracker reports the queues of its partitions.
    process = models.CharField(max_length=200)
    queue = models.CharField(max_length=MAX_QUEUE_LENGTH)
    in_progress = models.IntegerField(default=0)
    #: The tracker's totals since it started (rates are their differences between samples).
    redelivered = models.BigIntegerField(default=0)
    dead_lettered = models.BigIntegerField(default=0)

    class Meta:
        db_table = "outbox_queue_history"
        verbose_name = "queue sample"
        ordering = ["at"]
        indexes = [models.Index(fields=["at"], name="outbox_queue_history_at")]

    def __str__(self) -> str:
        return f"{self.queue} at {self.at}"


class Queue(QueueProcess):
    """Admin's entry point for the per-queue pages (a proxy: no table of its own)."""

    class Meta:
        proxy = True
        verbose_name = "queue"
