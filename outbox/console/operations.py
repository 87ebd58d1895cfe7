"""What an operator does to records from the admin, through the engine's own SQL and signals.

A running leader learns of each action without a restart: it re-reads the rows it holds every
second (a deleted or parked row releases its key; a row whose version changed is retried at
once, alone), and a NOTIFY on the table's channel makes it look at once.

- requeue: clear the failure count of rows no live leader has read (the engine's REQUEUE); the next
  term reads them again in any case, so this only says they are no longer stuck;
- retry now: touch held rows (any UPDATE gives a row a new version), so the leader retries them;
- park: move held rows to the dead-letter table (the engine's PARK), after publishing each to
  `OUTBOX["dead_letter_topic"]` when one is set; the key's later records go on;
- republish: move parked rows back into the outbox with new ids, so each is published after the
  records of its key written since.

Each function decides per row, and returns an Outcome: one message saying what was done, and what
was left alone and why.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from django.contrib.messages import SUCCESS, WARNING
from django.db import connections, transaction
from django.db.models.expressions import RawSQL
from psycopg import sql

from outbox import conf
from outbox.harvest import contract, store
from outbox.harvest.store import table_identifier, table_name
from outbox.models import DeadLetter, OutboxRecord
from outbox.states import Facts

#: Ids named in one message; beyond, "... (N in all)".
MESSAGE_IDS = 10

# Republish: one parked row back into the outbox, in one statement (so it is in exactly one of the
# two tables). The row takes a new id and create_time: it is published after every record of its
# key written since it was first stashed, and its latency is counted from now.
REPUBLISH = """
WITH moved AS (
  DELETE FROM {dead_letters} WHERE id = %(id)s
  RETURNING kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values
)
INSERT INTO {table} (kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values)
SELECT kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values FROM moved
RETURNING id
"""

# Retry now: any UPDATE gives a held row a new version (xmin), which its leader notices when it
# re-reads its held rows (every second, or at once after a NOTIFY) and retries the row, alone.
RETRY = """
UPDATE {table} SET last_error = %(note)s
WHERE id = ANY(%(ids)s)
RETURNING id
"""


@dataclass
class Outcome:
    """What an action did to the records it was given, said in one sentence."""

    #: "Requeued 2 records: #1, #2" ...
    verb: str
    #: ... or "Nothing requeued".
    nothing: str
    asked: int
    done: list[int] = field(default_factory=list)
    #: Why records were left alone: reason -> their ids.
    skipped: dict[str, list[int]] = field(default_factory=dict)
    #: Further sentences (whether the dead-letter topic got the records, say).
    notes: list[str] = field(default_factory=list)
    #: Something went wrong beyond skipping (the dead-letter topic could not be reached, say).
    trouble: bool = False

    def skip(self, record_id: int, reason: str) -> None:
        self.skipped.setdefault(reason, []).append(record_id)

    @property
    def level(self) -> int:
        return SUCCESS if self.done and not self.skipped and not self.trouble else WARNING

    def message(self) -> str:
        if not self.done:
            head = self.nothing
        elif not self.skipped:
            head = f"{self.verb} {plural(len(self.done), 'record')}: {ids_text(self.done)}"
        else:
            head = f"{self.verb} {len(self.done)} of {plural(self.asked, 'record')} ({ids_text(self.done)})"
        why = "; ".join(f"{ids_text(ids)} {'is' if len(ids) == 1 else 'are'} {reason}"
                        for reason, ids in self.skipped.items())
        if why:
            head += f"; {why}" if self.done else f": {why}"
        return ". ".join([head, *self.notes]) + "."


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def ids_text(ids: Sequence[int]) -> str:
    shown = ", ".join(f"#{i}" for i in ids[:MESSAGE_IDS])
    return shown if len(ids) <= MESSAGE_IDS else f"{shown}, ... ({len(ids)} in all)"


#: Why a row was left alone (after "#5 is" / "#5, #6 are").
HELD = "held by the leader (use Retry now or Park)"
LIVE = "read by the live leader (it may be in flight)"
NOT_HELD = "not held by a live leader (released or published meanwhile)"
GONE = "no longer in the outbox"
NOT_PARKED = "no longer parked"


def requeue(ids: Iterable[int], facts: Facts, using: str | None = None) -> Outcome:
    """Clear the failure count of rows no live leader has read (held rows: retry them instead)."""
    using = using or conf.database_alias()
    ids = sorted(set(ids))
    outcome = Outcome("Requeued", "Nothing requeued", len(ids))
    upto = facts.replicas.marked_upto
    with transaction.atomic(using=using):
        # Locked, so the rows requeued are exactly the rows found requeueable here.
        present = set(OutboxRecord.objects.using(using).select_for_update().filter(id__in=ids)
                      .values_list("id", flat=True))
        for record_id in ids:
            if record_id not in present:
                outcome.skip(record_id, GONE)
            elif record_id in facts.held:
                outcome.skip(record_id, HELD)
            elif upto is not None and record_id <= upto:
                outcome.skip(record_id, LIVE)
            else:
                outcome.done.append(record_id)
        if outcome.done:
            # The engine's REQUEUE, on this transaction's connection (the locking query above opened it).
            store.requeue(connections[using].connection, OutboxRecord._meta.db_table, outcome.done)
    return outcome


def retry_now(ids: Iterable[int], facts: Facts, user: str, using: str | None = None) -> Outcome:
    """Touch held rows: the leader sees each row's new version within a second (at once, with the
    NOTIFY) and sends it again, alone; if it fails again, it is held again."""
    using = using or conf.database_alias()
    ids = sorted(set(ids))
    outcome = Outcome("Asked the leader to retry", "Nothing retried", len(ids))
    targets = _held(ids, facts, outcome)
    if targets:
        note = f"retry requested by {user} at {datetime.now().astimezone():%Y-%m-%d %H:%M:%S %Z}"
        with transaction.atomic(using=using):
            cursor = _cursor(using)
            cursor.execute(sql.SQL(RETRY).format(table=_table()), {"ids": targets, "note": note})
            touched = {row[0] for row in cursor.fetchall()}
            if touched:
                notify(using)
        for record_id in targets:
            if record_id in touched:
                outcome.done.append(record_id)
            else:
                outcome.skip(record_id, NOT_HELD)
    return outcome


@dataclass(frozen=True)
class Parked:
    outbox_id: int
    dead_letter_id: int


def park(ids: Iterable[int], facts: Facts, user: str, using: str | None = None) -> tuple[Outcome, list[Parked]]:
    """Move held rows to the dead-letter table (publishing each to the dead-letter topic first, when
    one is set); the leader sees each row gone and lets its key's later records go on."""
    using = using or conf.database_alias()
    ids = sorted(set(ids))
    outcome = Outcome("Parked", "Nothing parked", len(ids))
    targets = _held(ids, facts, outcome)
    # With each row's version: it is parked only as it is now (a row changed meanwhile is retried instead).
    records = list(OutboxRecord.objects.using(using).filter(id__in=targets)
                   .annotate(version=RawSQL("xmin::text::bigint", [])).order_by("id"))
    topic = conf.setting("dead_letter_topic")
    published: set[int] = set()
    failure = ""
    if topic and records:
        published, failure = publish_dead_letters(topic, [(r, facts.held[r.id].reason) for r in records])
    statement = sql.SQL(contract.PARK).format(table=_table(), dead_letters=_dead_letters())
    with transaction.atomic(using=using):
        cursor = _cursor(using)
        for record in records:
            held = facts.held[record.id]
            cursor.execute(statement, {"id": record.id, "version": record.version, "reason": held.reason,
                                       "attempts": held.attempts, "parked_by": f"admin {user}",
                                       "dead_letter_topic": topic if record.id in published else None})
            if cursor.fetchone() is not None:
                outcome.done.append(record.id)
        if outcome.done:
            notify(using)
    for record_id in targets:
        if record_id not in outcome.done:
            outcome.skip(record_id, NOT_HELD)
    if topic and records:
        _say_published(outcome, topic, published, failure)
    parked = [Parked(dead.outbox_id, dead.id)
              for dead in DeadLetter.objects.using(using).filter(outbox_id__in=outcome.done).order_by("outbox_id")]
    return outcome, parked


def publish_dead_letters(topic: str, records: list[tuple[OutboxRecord, str]]) -> tuple[set[int], str]:
    """Publish records to the dead-letter topic with the headers the engine gives a parked record,
    using the project's Kafka settings; returns the ids Kafka acknowledged, and the first error."""
    from confluent_kafka import KafkaException, Producer

    from outbox.harvest.kafka import dead_letter_producer_config
    from outbox.reasons import kafka_reason

    config = conf.harvest_config()
    acked: set[int] = set()
    errors: list[str] = []

    def delivered(record_id: int, error: Any) -> None:
        if error is None:
            acked.add(record_id)
        else:
            errors.append(error.str())

    try:
        producer = Producer({**dead_letter_producer_config(config), "client.id": "outbox-admin-dead-letters"})
        for record, reason in records:
            headers = contract.dead_letter_headers(record.id, record.create_time, record.kafka_topic,
                                                   record.headers, reason)
            producer.produce(topic, value=record.kafka_value, key=record.kafka_key, headers=headers,
                             on_delivery=functools.partial(lambda record_id, error, _message: delivered(
                                 record_id, error), record.id))
        producer.flush(config.limits.delivery_timeout)
    except (KafkaException, BufferError) as error:
        errors.append(kafka_reason(error))
    if not errors and len(acked) < len(records):
        errors.append(f"no acknowledgement within {config.limits.delivery_timeout:g}s")
    return acked, errors[0] if errors else ""


def _say_published(outcome: Outcome, topic: str, published: set[int], failure: str) -> None:
    parked_only = [i for i in outcome.done if i not in published]
    published_only = sorted(published - set(outcome.done))
    if outcome.done and not parked_only:
        outcome.notes.append(f"Also published to dead-letter topic {topic}")
    if parked_only:
        outcome.notes.append(f"Publishing {ids_text(parked_only)} to dead-letter topic {topic} failed ({failure}): "
                             f"parked in the dead-letter table only")
        outcome.trouble = True
    if published_only:
        outcome.notes.append(f"{ids_text(published_only)} went to dead-letter topic {topic} but was gone from the "
                             f"outbox when it was to be parked")
        outcome.trouble = True


@dataclass(frozen=True)
class Republished:
    dead_letter: DeadLetter
    new_id: int


def republish(ids: Iterable[int], using: str | None = None) -> tuple[Outcome, list[Republished]]:
    """Move parked rows back into the outbox, in their original order, each with a new id."""
    using = using or conf.database_alias()
    ids = sorted(set(ids))
    outcome = Outcome("Republished", "Nothing republished", len(ids))
    statement = sql.SQL(REPUBLISH).format(table=_table(), dead_letters=_dead_letters())
    done: list[Republished] = []
    with transaction.atomic(using=using):
        cursor = _cursor(using)
        found = list(DeadLetter.objects.using(using).select_for_update().filter(id__in=ids)
                     .order_by("outbox_id", "id"))
        for dead in found:
            cursor.execute(statement, {"id": dead.id})
            done.append(Republished(dead, cursor.fetchone()[0]))
            outcome.done.append(dead.outbox_id)
        # The table's trigger sends the NOTIFY that wakes the leader: rows were inserted.
    for missing in sorted(set(ids) - {d.id for d in found}):
        outcome.skip(missing, NOT_PARKED)
    if done:
        outcome.notes.append("Back in the outbox as " + ", ".join(f"#{r.new_id} (was #{r.dead_letter.outbox_id})"
                                                                  for r in done[:MESSAGE_IDS])
                             + (f", ... ({len(done)} in all)" if len(done) > MESSAGE_IDS else ""))
    return outcome, done


def notify(using: str) -> None:
    """Wake the leader now (delivered when the transaction commits), rather than within a second."""
    cursor = _cursor(using)
    cursor.execute(contract.TABLE_OID, {"table": table_name(OutboxRecord._meta.db_table)})
    cursor.execute("SELECT pg_notify(%s, '')", [contract.notify_channel(cursor.fetchone()[0])])


def _held(ids: list[int], facts: Facts, outcome: Outcome) -> list[int]:
    """The ids a live leader holds; the others are noted as skipped."""
    targets = []
    for record_id in ids:
        if record_id in facts.held:
            targets.append(record_id)
        else:
            outcome.skip(record_id, NOT_HELD)
    return targets


def _table() -> sql.Composable:
    return table_identifier(OutboxRecord._meta.db_table)


def _dead_letters() -> sql.Composable:
    return table_identifier(DeadLetter._meta.db_table)


def _cursor(using: str) -> psycopg.Cursor:
    """A psycopg cursor on Django's connection, so the engine's SQL runs in the caller's transaction."""
    connection = connections[using]
    connection.ensure_connection()
    return connection.connection.cursor()
