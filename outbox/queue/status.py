"""A queue process's status row (the admin's live consumers and trackers), written from a thread of its own."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from django.db import DatabaseError, close_old_connections, connections

from outbox.queue import store
from outbox.queue.markers_consumer import QueueConsumer
from outbox.queue.runner import HandlerRunner
from outbox.queue.tracker import RedeliveryTracker
from outbox.reasons import first_line

log = logging.getLogger(__name__)
#: How often a tracker deletes expired dead letters (seconds).
DEAD_LETTER_PRUNE_INTERVAL = 60.0

#: () -> (messages in progress, stats for the row)
Snapshot = Callable[[], tuple[int, dict[str, Any]]]
#: () -> (redelivered, dead-lettered) totals per queue since the process started
Totals = Callable[[], tuple[Mapping[str, int], Mapping[str, int]]]


class QueueStatusReporter(threading.Thread):
    """Upserts the row every `interval` seconds until stopped, then deletes it; a tracker's counts ride along."""

    def __init__(self, name: str, kind: str, *, interval: float, snapshot: Snapshot, queue: str = "",
                 totals: Totals | None = None, history_interval: float = 0.0,
                 history_retention: float = 24 * 3600.0, dead_letter_retention: float | None = None) -> None:
        super().__init__(name="queue-status", daemon=True)
        self.process_name, self.kind, self.queue = name, kind, queue
        self._interval, self._snapshot, self._totals = interval, snapshot, totals
        # A tracker's stats carry each queue's figures: they are sampled into the history (the charts).
        self._history_interval, self._history_retention = history_interval, history_retention
        self._next_sample = 0.0
        # A tracker also deletes dead letters older than dead_letter_retention (None: never), once a minute.
        self._dead_letter_retention, self._next_prune = dead_letter_retention, 0.0
        self._since = datetime.now(UTC)
        self._halt = threading.Event()
        self._counted: tuple[dict[str, int], dict[str, int]] = ({}, {})
        self._failing = False

    def stop(self) -> None:
        """Write the last counts, delete the row and end the thread (waits up to 10 s)."""
        self._halt.set()
        if self.is_alive():
            self.join(timeout=10)

    def run(self) -> None:
        try:
            self._write()
            while not self._halt.wait(self._interval):
                self._write()
            self._count()
            store.remove_status(self.process_name)
        except DatabaseError as error:
            log.warning("Could not remove the status row of %s: %s", self.process_name, first_line(error))
        finally:
            connections.close_all()

    def _write(self) -> None:
        close_old_connections()
        try:
            in_progress, stats = self._snapshot()
            store.write_status(self.process_name, self.kind, queue=self.queue, started=self._since,
                               in_progress=in_progress, stats=stats)
            self._count()
            self._sample(stats)
            self._prune_dead_letters()
        except DatabaseError as error:
            if not self._failing:
                log.warning("Status row of %s not written: %s (retrying every %gs)", self.process_name,
                            first_line(error), self._interval)
            self._failing = True
            return
        if self._failing:
            log.info("Status row of %s written again", self.process_name)
        self._failing = False

    def _prune_dead_letters(self) -> None:
        if self.kind != "tracker" or self._dead_letter_retention is None or time.monotonic() < self._next_prune:
            return
        self._next_prune = time.monotonic() + DEAD_LETTER_PRUNE_INTERVAL
        deleted = store.prune_dead_letters(self._dead_letter_retention)
        if deleted:
            log.info("Deleted %d dead letter(s) older than %gs (dead_letter_retention)", deleted,
                     self._dead_letter_retention)

    def _sample(self, stats: dict[str, Any]) -> None:
        """Every history_interval: a tracker's (or a share consumer's) in progress, redelivered and dead-lettered per
        queue. A share queue has no tracker: its consumers report what the broker redelivered to them."""
        if "redelivered" not in stats or not self._history_interval or time.monotonic() < self._next_sample:
            return
        self._next_sample = time.monotonic() + self._history_interval
        queues = stats.get("queues") or {}
        redelivered, dead = stats.get("redelivered") or {}, stats.get("dead_lettered") or {}
        store.add_samples(self.process_name, {
            queue: (int((queues.get(queue) or {}).get("in_progress") or 0), int(redelivered.get(queue, 0)),
                    int(dead.get(queue, 0))) for queue in sorted(set(queues) | set(redelivered) | set(dead))},
            self._history_retention)

    def _count(self) -> None:
        if self._totals is None:
            return
        redelivered, dead = (dict(t) for t in self._totals())
        done_redelivered, done_dead = self._counted
        store.add_counts({q: n - done_redelivered.get(q, 0) for q, n in redelivered.items()
                          if n != done_redelivered.get(q, 0)},
                         {q: n - done_dead.get(q, 0) for q, n in dead.items() if n != done_dead.get(q, 0)})
        self._counted = (redelivered, dead)


def tracker_status(tracker: RedeliveryTracker) -> tuple[int, dict[str, Any]]:
    """A tracker's row: messages in progress per queue (with the oldest start), partitions, markers read."""
    view = tracker.snapshot
    queues = {queue: {"in_progress": stats.in_progress, "oldest_started": stats.oldest_started}
              for queue, stats in view.queues.items()}
    markers = {queue: {"starts": view.starts.get(queue, 0), "ends": view.ends.get(queue, 0)}
               for queue in sorted(set(view.starts) | set(view.ends))}
    return sum(s.in_progress for s in view.queues.values()), {
        "partitions": view.partitions, "replaying": view.replaying, "queues": queues, "markers": markers,
        "redelivered": view.redelivered, "dead_lettered": view.dead_lettered,
        "waiting": waiting_status(tracker.waiting_for())}


def consumer_status(consumer: QueueConsumer, runner: HandlerRunner | None = None,
                    handler: str = "") -> tuple[int, dict[str, Any]]:
    """A consumer's row: what it holds and its totals."""
    oldest = consumer.oldest_in_progress()
    share = {} if consumer.limits.backend != "share" else {  # no trackers: the consumers' figures are the queue's
        "queues": {consumer.queue: {"in_progress": consumer.in_progress}},
        "redelivered": {consumer.queue: consumer.redelivered},
        "dead_lettered": {consumer.queue: consumer.dead_lettered}}
    return consumer.in_progress, {**share,
        "handler": handler, "workers": runner.workers if runner else 0, "inbox": bool(runner and runner.inbox),
        "received": consumer.received, "acked": consumer.acked, "retried": consumer.retried,
        "abandoned": consumer.abandoned, "skipped": runner.skipped if runner else 0,
        "limits": dataclasses.asdict(consumer.limits),
        "oldest_in_progress_seconds": None if oldest is None else round(time.monotonic() - oldest, 3),
        "waiting": waiting_status(consumer.waiting_for())}


def waiting_status(waiting: tuple[str, float] | None) -> dict[str, Any] | None:
    """What a process waits for while Kafka is away, for its row (outbox_queue_health reads it)."""
    return None if waiting is None else {"for": waiting[0], "seconds": round(waiting[1], 1)}

