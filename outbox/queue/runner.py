"""Runs a handler for each message of a queue on worker threads: `manage.py outbox_consume`.

The handler is a function taking a Message. It returns: the message is acked. It raises Retry:
the message is redelivered after Retry's delay (at once by default). It raises anything else:
no ack, and the message is redelivered once its redelivery timeout passes.

With `inbox`, the handler runs in transaction.atomic() together with an inbox row keyed by the
message id. A delivery whose row is already there (its effects committed, but the ack was lost
to a crash) is acked without running the handler: effectively once into the database.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from django.db import close_old_connections, connections, transaction

from outbox.queue import store
from outbox.queue.consumer import Message, QueueConsumer
from outbox.queue.errors import QueueError, Retry

log = logging.getLogger(__name__)

Handler = Callable[[Message], Any]


class HandlerRunner:
    """`workers` threads share one consumer; stop() lets each finish the message in hand."""

    def __init__(self, consumer: QueueConsumer, handler: Handler, *, workers: int = 1, inbox: bool = False,
                 using: str = "default") -> None:
        self.consumer, self.handler, self.workers, self.inbox, self.using = consumer, handler, workers, inbox, using
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
        """Run the handler on one message and settle it: ack, retry or abandon.

        With tracing on, the handler runs with the delivery's span current (docs/tracing.md)."""
        close_old_connections()
        span = message.span
        try:
            if span is None:
                self._run_handler(message)
            else:
                from outbox.tracing.consume import activate, handler_failed

                with activate(span):
                    try:
                        self._run_handler(message)
                    except Retry:
                        raise
                    except Exception as error:
                        handler_failed(span, error)
                        raise
        except Retry as retry:
            log.info("Handler asked to retry %r in %gs: %s", message, retry.delay, retry)
            message.retry(retry.delay)
        except Exception as error:
            log.warning("Handler failed on %r; no ack, redelivered after %gs: %s", message,
                        self.consumer.limits.redelivery_timeout, error, exc_info=True)
            message.abandon()
        else:
            message.ack()
        finally:
            close_old_connections()

    def _run_handler(self, message: Message) -> None:
        if self.inbox:
            self._handle_with_inbox(message)
        else:
            self.handler(message)

    def _handle_with_inbox(self, message: Message) -> None:
        with transaction.atomic(using=self.using):
            if not store.claim(message.queue, message.id, self.using):
                self.skipped += 1
                log.info("%r was processed before (inbox): acked without running the handler", message)
                return
            self.handler(message)
