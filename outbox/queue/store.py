"""What queue processes write to the database: dead letters, inbox rows, status rows and counters.

Each function runs on the calling thread's Django connection; a connection left broken by an
outage is replaced before the next call (close_old_connections), so a tracker or consumer rides
out a database restart.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import DatabaseError, connections, transaction
from django.db.models import Model
from django.utils import timezone

from outbox.queue import models
from outbox.queue.tracker import DeadLetter
from outbox.reasons import first_line

#: Status rows not seen for this long are deleted by whichever process notices.
STATUS_PRUNE_AFTER = timedelta(hours=1)
#: Inbox rows are deleted in batches of this many, so a prune never holds a long lock.
PRUNE_BATCH = 10_000

COUNT = """
INSERT INTO {table} (queue, redelivered, dead_lettered, updated) VALUES (%s, %s, %s, now())
ON CONFLICT (queue) DO UPDATE SET redelivered = {table}.redelivered + EXCLUDED.redelivered,
    dead_lettered = {table}.dead_lettered + EXCLUDED.dead_lettered, updated = now()
"""
CLAIM = "INSERT INTO {table} (queue, message_id) VALUES (%s, %s) ON CONFLICT DO NOTHING RETURNING 1"


class DatabaseUnavailable(Exception):
    """The queue's tables cannot be used; the message is one line for the operator."""


def require_tables(*tables: type[models.models.Model], using: str = "default") -> None:
    """Fail early, in one line, when the database is unreachable or the queue app is not migrated."""
    connection = connections[using]
    where = f"{connection.settings_dict.get('HOST') or 'localhost'}:{connection.settings_dict.get('PORT') or 5432}/" \
            f"{connection.settings_dict.get('NAME')}"
    try:
        with connection.cursor() as cursor:
            missing = [t._meta.db_table for t in tables if t._meta.db_table not in
                       connection.introspection.table_names(cursor)]
    except DatabaseError as error:
        raise DatabaseUnavailable(f"cannot connect to Postgres at {where}: {first_line(error)}") from None
    finally:
        connection.close()
    if missing:
        raise DatabaseUnavailable(f"table(s) {', '.join(missing)} missing at {where}: "
                                  f"run manage.py migrate outbox_queue")


def store_dead_letters(letters: Sequence[DeadLetter]) -> None:
    """The tracker's dead-letter sink: one row per message; a message already stored is left as it is.

    Runs on the tracker's thread; dead letters are rare, so the connection is closed after each
    call rather than held by a thread that never ends a request.
    """
    try:
        _store_dead_letters(letters)
    finally:
        connections["default"].close()


def store_share_dead_letters(letters: Sequence[DeadLetter]) -> None:
    """The share backend's dead-letter sink: the rows, and the per-queue counter the admin shows."""
    try:
        _store_dead_letters(letters)
        counts: dict[str, int] = {}
        for letter in letters:
            counts[letter.queue] = counts.get(letter.queue, 0) + 1
        add_counts({}, counts)
    finally:
        connections["default"].close()


def _store_dead_letters(letters: Sequence[DeadLetter]) -> None:
    models.DeadLetter.objects.bulk_create([
        models.DeadLetter(queue=letter.queue, message_id=letter.message_id, key=letter.key, payload=letter.payload,
                          headers=[[k, v.decode("utf-8", "replace")] for k, v in letter.headers],
                          deliveries=letter.deliveries,
                          last_delivered=datetime.fromtimestamp(letter.started, UTC))
        for letter in letters], ignore_conflicts=True)


def add_counts(redelivered: Mapping[str, int], dead_lettered: Mapping[str, int]) -> None:
    """Add a tracker's new redeliveries and dead letters to the per-queue counters."""
    queues = sorted(set(redelivered) | set(dead_lettered))
    if not queues:
        return
    sql = COUNT.format(table=models.QueueCounter._meta.db_table)
    with connections["default"].cursor() as cursor:
        cursor.executemany(sql, [(q, redelivered.get(q, 0), dead_lettered.get(q, 0)) for q in queues])


def claim(queue: str, message_id: str, using: str = "default") -> bool:
    """Insert the message's inbox row in the current transaction; False if it was there (already processed).

    Two deliveries of one message running at once: the second insert waits on the first's row
    lock and finds the row once the first commits, so only one runs the handler to the end.
    """
    with connections[using].cursor() as cursor:
        cursor.execute(CLAIM.format(table=models.InboxEntry._meta.db_table), [queue, message_id])
        return cursor.fetchone() is not None


def prune_inbox(retention: float, using: str = "default") -> int:
    """Delete inbox rows older than `retention` seconds; returns how many."""
    return _prune(models.InboxEntry, "processed", retention, using)


def prune_dead_letters(retention: float, using: str = "default") -> int:
    """Delete dead letters written more than `retention` seconds ago; returns how many."""
    return _prune(models.DeadLetter, "created", retention, using)


def _prune(model: type[Model], field: str, retention: float, using: str) -> int:
    """Delete `model`'s rows whose `field` is older than `retention` seconds, a batch at a time."""
    before = timezone.now() - timedelta(seconds=retention)
    deleted = 0
    while True:
        ids = list(model.objects.using(using).filter(**{f"{field}__lt": before})  # type: ignore[attr-defined]
                   .values_list("pk", flat=True)[:PRUNE_BATCH])
        if not ids:
            return deleted
        deleted += model.objects.using(using).filter(pk__in=ids).delete()[0]  # type: ignore[attr-defined]


def write_status(name: str, kind: str, *, queue: str = "", started: datetime, in_progress: int,
                 stats: dict[str, Any]) -> None:
    """Upsert this process's status row, and prune rows of processes long gone."""
    now = timezone.now()
    with transaction.atomic():
        models.QueueProcess.objects.update_or_create(name=name, defaults={
            "kind": kind, "queue": queue, "host": socket.gethostname(), "pid": os.getpid(), "started": started,
            "last_seen": now, "in_progress": in_progress, "stats": stats})
        models.QueueProcess.objects.filter(last_seen__lt=now - STATUS_PRUNE_AFTER).delete()


def add_samples(process: str, samples: Mapping[str, tuple[int, int, int]], retention: float) -> None:
    """A tracker's history: (in progress, redelivered, dead-lettered) per queue now; samples older than
    `retention` seconds are deleted."""
    now = timezone.now()
    with transaction.atomic():
        models.QueueSample.objects.bulk_create([
            models.QueueSample(at=now, process=process, queue=queue, in_progress=in_progress, redelivered=redelivered,
                               dead_lettered=dead) for queue, (in_progress, redelivered, dead) in samples.items()])
        models.QueueSample.objects.filter(at__lt=now - timedelta(seconds=retention)).delete()


def remove_status(name: str) -> None:
    models.QueueProcess.objects.filter(name=name).delete()
