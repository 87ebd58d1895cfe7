"""Runs a handler for each message of a queue on worker threads: `manage.py outbox_consume`.

The handler is a function taking a Message; what its outcome does to the message is handling.py's.
With `inbox`, the handler runs in transaction.atomic() together with an inbox row keyed by the
message id. A delivery whose row is already there (its effects committed, but the ack was lost
to a crash) is acked without running the handler: effectively once into the database.
"""

from __future__ import annotations

import logging
import threading
from contextlib import AbstractContextManager
from typing import Any

from django.db import close_old_connections, connections, transaction

from outbox.queue import handling, store
from outbox.queue.errors import QueueError
from outbox.queue.handling import Handler
from outbox.queue.markers_consumer import Message, QueueConsumer

log = logging.getLogger(__name__)


class HandlerRunner:
    """`workers` threads share one consumer; stop() lets each finish the message in hand."""

    def __init__(self, consumer: QueueConsumer, handler: Handler, *, workers: int = 1, inbox: bool = False,
                 using: str = "default") -> None:
        self.consumer, self.handler, self.workers, self.inbox, self.using = consumer, handler, workers, inbox, using
        self._inbox = DatabaseInbox(using) if inbox else None
        self._halt = threading.Event()
        self._threads: list[threading.Thread] = []
        self.failure: QueueError | None = None
        #: Deliveries acked without running the handler (the inbox had them).
        self.skipped = 0

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._work, name=f"queue-worker-{n}", daemon=True)
                         for n in range(self.workers)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Ask the workers to stop after the message in hand; returns at once."""
        self._halt.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the workers to finish; True if they all did."""
        for thread in self._threads:
            thread.join(timeout)
        return not any(thread.is_alive() for thread in self._threads)

    def _work(self) -> None:
        try:
            while not self._halt.is_set():
                try:
                    message = self.consumer.receive(timeout=0.2)
                except QueueError as error:
                    self.failure = self.failure or error
                    self._halt.set()
                    return
                if message is not None:
                    self.handle(message)
        finally:
            connections.close_all()

    def handle(self, message: Message) -> None:
        """Run the handler on one message and settle it: ack, retry or abandon (handling.py)."""
        close_old_connections()
        try:
            if handling.handle(message, self.handler, self._inbox) is handling.Outcome.SKIPPED:
                self.skipped += 1
        finally:
            close_old_connections()


class DatabaseInbox:
    """The inbox table (outbox.queue.models.InboxEntry) in one of Django's databases."""

    def __init__(self, using: str) -> None:
        self.using = using

    def atomic(self) -> AbstractContextManager[Any]:
        return transaction.atomic(using=self.using)

    def claim(self, queue: str, message_id: str) -> bool:
        return store.claim(queue, message_id, self.using)
