"""The outbox table, in goharvest's format so that any application can INSERT into it with plain SQL."""

from __future__ import annotations

from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models.functions import Now

#: Kafka's limit on topic names.
MAX_TOPIC_LENGTH = 249
#: The key column's width, in characters; stash() enforces it before any SQL runs.
MAX_KEY_LENGTH = 1000


class OutboxRecord(models.Model):
    """One Kafka message waiting to be published; deleted once Kafka has acknowledged it."""

    id = models.BigAutoField(primary_key=True)
    create_time = models.DateTimeField(db_default=Now())
    kafka_topic = models.CharField(max_length=MAX_TOPIC_LENGTH)
    kafka_key = models.CharField(max_length=MAX_KEY_LENGTH)
    #: NULL publishes a tombstone (a message with no value).
    kafka_value = models.TextField(null=True, blank=True)
    kafka_header_keys = ArrayField(models.TextField(), default=list, blank=True)
    kafka_header_values = ArrayField(models.TextField(), default=list, blank=True)
    #: The harvester term that marked the row as in flight; NULL when pending.
    leader_id = models.UUIDField(null=True, blank=True)

    class Meta:
        db_table = "outbox"
        verbose_name = "outbox record"
        ordering = ["id"]

    def __str__(self) -> str:
        return f"#{self.id} {self.kafka_topic}/{self.kafka_key}"

    @property
    def headers(self) -> list[tuple[str, str]]:
        return list(zip(self.kafka_header_keys, self.kafka_header_values, strict=True))
