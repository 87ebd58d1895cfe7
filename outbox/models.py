"""The outbox table, in goharvest's format so that any application can INSERT into it with plain SQL."""

from __future__ import annotations

from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models.functions import Now

from outbox.harvest.contract import ReplicaState

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
    #: Times a delivery of this row failed (reset) or was refused (held); not in goharvest's schema,
    #: so plain-SQL writers need not know it (it defaults to 0).
    reset_count = models.IntegerField(db_default=0, default=0)
    #: The last delivery error, for operators.
    last_error = models.TextField(null=True, blank=True)

    class Meta:
        db_table = "outbox"
        verbose_name = "outbox record"
        ordering = ["id"]
        indexes = [
            # Rows that ever failed: few, and the mark UPDATE never changes reset_count, so this
            # index does not cost the mark its HOT update.
            models.Index(fields=["id"], name="outbox_failed_idx", condition=models.Q(reset_count__gt=0)),
        ]

    def __str__(self) -> str:
        return f"#{self.id} {self.kafka_topic}/{self.kafka_key}"

    @property
    def headers(self) -> list[tuple[str, str]]:
        return list(zip(self.kafka_header_keys, self.kafka_header_values, strict=True))


class HarvesterStatus(models.Model):
    """One running harvester replica, upserted by the replica every `status_interval` seconds."""

    STATES = [(state.value, state.value) for state in ReplicaState]

    name = models.CharField(max_length=200, primary_key=True)
    host = models.CharField(max_length=255)
    pid = models.IntegerField()
    state = models.CharField(max_length=20, choices=STATES)
    leader_id = models.UUIDField(null=True, blank=True)
    #: The highest outbox id its term has read: rows up to it (and not purged yet) are in flight.
    marked_upto = models.BigIntegerField(null=True, blank=True)
    #: When the replica entered its current state.
    since = models.DateTimeField()
    started = models.DateTimeField()
    last_seen = models.DateTimeField()
    harvested_table = models.CharField(max_length=200)
    leader_topic = models.CharField(max_length=249)
    leader_group = models.CharField(max_length=255)
    #: Records sent and not yet acknowledged and purged.
    in_flight = models.IntegerField(default=0)
    #: Records marked by the leader, waiting to be sent (not counting those behind a held record).
    queued = models.IntegerField(default=0)
    #: A bounded sample of the keys in flight; in_flight_key_count is the total.
    in_flight_keys = ArrayField(models.TextField(), default=list, blank=True)
    in_flight_key_count = models.IntegerField(default=0)
    #: Keys held because a record of theirs cannot be published (poison), as "key: reason".
    held_keys = ArrayField(models.TextField(), default=list, blank=True)
    #: The held records themselves: [{"id": ..., "key": ..., "reason": ...}].
    held = models.JSONField(default=list, blank=True)
    #: Set while the replica leads its group but another replica holds the table's database fence.
    blocked_by = models.TextField(null=True, blank=True)
    throughput = models.FloatField(default=0.0)
    published = models.BigIntegerField(default=0)
    failed = models.BigIntegerField(default=0)
    #: With shards (OUTBOX["shards"] > 1) each row is one engine of a replica: the shard it harvests
    #: (NULL: the whole table), and how many shards its group has.
    shard = models.IntegerField(null=True, blank=True)
    shards = models.IntegerField(db_default=1, default=1)

    class Meta:
        db_table = "outbox_harvester"
        verbose_name = "harvester"
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.state})"


class ShardTerm(models.Model):
    """Who last led each shard of a sharded outbox, and whether it let go settled (outbox.harvest.sharding).

    A shard's leader claims the row when it takes the shard's fence and marks it settled just before it lets
    the fence go with nothing in flight. A successor that finds it unsettled (the session holding the fence
    ended: a crash, a dropped connection, a terminated backend) waits for that leader's last records to land
    before it marks, as after a fence taken from another group."""

    id = models.BigAutoField(primary_key=True)
    #: The outbox table (its oid), how many shards, which one.
    table_oid = models.BigIntegerField()
    shards = models.IntegerField()
    shard = models.IntegerField()
    #: The leader's engine and its fence session, e.g. "replica-a-s3 (session 4242)".
    holder = models.TextField()
    settled = models.BooleanField(default=False)
    updated = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "outbox_harvester_shards"
        verbose_name = "shard term"
        constraints = [models.UniqueConstraint(fields=["table_oid", "shards", "shard"], name="outbox_shard_term_key")]

    def __str__(self) -> str:
        return f"shard {self.shard}/{self.shards}: {self.holder} ({'settled' if self.settled else 'leading'})"


class HarvesterSample(models.Model):
    """A replica's figures at one moment, for the dashboard's charts: written by its status reporter every
    `history_interval` seconds (outbox.harvest.status), deleted after `history_retention` seconds."""

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=200)
    at = models.DateTimeField(db_default=Now())
    state = models.CharField(max_length=20, choices=HarvesterStatus.STATES)
    leader_id = models.UUIDField(null=True, blank=True)
    #: When the replica entered `state`: a leader's `since` is the moment it took the lead.
    since = models.DateTimeField()
    harvested_table = models.CharField(max_length=200)
    leader_group = models.CharField(max_length=255)
    #: Totals since the replica started (rates are their differences between samples).
    published = models.BigIntegerField(default=0)
    failed = models.BigIntegerField(default=0)
    in_flight = models.IntegerField(default=0)
    queued = models.IntegerField(default=0)
    held = models.IntegerField(default=0)
    #: Rows in the harvested table: counted up to 10,000, Postgres's live-row estimate beyond.
    backlog = models.BigIntegerField(null=True, blank=True)
    #: Age of the table's oldest row, in seconds (NULL: the table was empty).
    oldest_age = models.FloatField(null=True, blank=True)
    #: What harvesting cost the database so far, by kind of statement (outbox.harvest.dbtime), as
    #: {kind: [count, seconds, rows]}: this replica's round trips since it started...
    db_round_trips = models.JSONField(null=True, blank=True)
    #: ...and the server's time for the table's statements, from pg_stat_statements since its last reset
    #: (NULL: the replica did not lead, or the database has no pg_stat_statements).
    db_statements = models.JSONField(null=True, blank=True)

    class Meta:
        db_table = "outbox_harvester_history"
        verbose_name = "harvester sample"
        ordering = ["at"]
        indexes = [models.Index(fields=["at"], name="outbox_harvester_history_at")]

    def __str__(self) -> str:
        return f"{self.name} at {self.at}"


class DeadLetter(models.Model):
    """A parked record: moved out of the outbox (by an operator, or after `park_after` failures) so the
    records of its key behind it could go on. Republishing puts it back in the outbox with a new id,
    so it is published after the key's later records."""

    id = models.BigAutoField(primary_key=True)
    outbox_id = models.BigIntegerField(help_text="Its id in the outbox when it was parked.")
    create_time = models.DateTimeField()
    kafka_topic = models.CharField(max_length=MAX_TOPIC_LENGTH)
    kafka_key = models.CharField(max_length=MAX_KEY_LENGTH)
    kafka_value = models.TextField(null=True, blank=True)
    kafka_header_keys = ArrayField(models.TextField(), default=list, blank=True)
    kafka_header_values = ArrayField(models.TextField(), default=list, blank=True)
    reason = models.TextField()
    attempts = models.IntegerField(default=0, help_text="Times it failed on its own before it was parked.")
    parked_at = models.DateTimeField(db_default=Now())
    parked_by = models.TextField(help_text="The harvester replica, or the admin user, that parked it.")
    dead_letter_topic = models.CharField(max_length=MAX_TOPIC_LENGTH, null=True, blank=True,
                                         help_text="Also published to this topic when parked.")

    class Meta:
        db_table = "outbox_dead_letter"
        verbose_name = "parked record"
        ordering = ["-parked_at"]

    def __str__(self) -> str:
        return f"#{self.outbox_id} {self.kafka_topic}/{self.kafka_key}"

    @property
    def headers(self) -> list[tuple[str, str]]:
        return list(zip(self.kafka_header_keys, self.kafka_header_values, strict=True))


class Dashboard(HarvesterStatus):
    """Admin's entry point for /admin/outbox/dashboard/ (a proxy: no table of its own)."""

    class Meta:
        proxy = True
        verbose_name = "dashboard"
        verbose_name_plural = "dashboard"
