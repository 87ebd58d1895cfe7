"""What a handler's outcome does to its message: ack, retry or abandon, and with an inbox, when.

    outcome = handle(message, handler, inbox)

The handler returns: the message is acked. It raises Retry: the message is redelivered after
Retry's delay. It raises anything else: no ack, and the message is redelivered once its
redelivery timeout passes. With an inbox (runner.py's is the database's), the handler runs in one
transaction with an inbox row keyed by the message id, and the ack is sent only after that
transaction committed: a crash in between leaves the message to be redelivered, and the inbox
row then acks the redelivery without running the handler again. Acking inside the transaction
would end the message even when its commit fails, losing it.

No Django here, so the simulator (tests/sim/) runs this same code with an inbox of its own.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from outbox.queue.errors import Retry
from outbox.queue.markers_consumer import Message

log = logging.getLogger(__name__)

Handler = Callable[[Message], Any]


class Inbox(Protocol):
    def atomic(self) -> AbstractContextManager[Any]:
        """A transaction: the inbox row and the handler's own writes commit together, or neither."""

    def claim(self, queue: str, message_id: str) -> bool:
        """Insert the message's row in the current transaction; False if it is there already."""


class Outcome(enum.Enum):
    HANDLED = "handled"
    SKIPPED = "skipped"  # the inbox had it: processed before, acked without running the handler
    RETRIED = "retried"
    FAILED = "failed"


def handle(message: Message, handler: Handler, inbox: Inbox | None = None) -> Outcome:
    """Run `handler` on `message` (in the inbox's transaction, if any), then settle the message.

    With tracing on, the handler runs with the delivery's span current (docs/tracing.md)."""
    try:
        outcome = _run(message, handler, inbox) if message.span is None else _run_traced(message, handler, inbox)
    except Retry as retry:
        log.info("Handler asked to retry %r in %gs: %s", message, retry.delay, retry)
        message.retry(retry.delay)
        return Outcome.RETRIED
    except Exception as error:
        what, with_traceback = message.after_failure()  # its backend says what abandoning it does
        log.warning("Handler failed on %r: %s: %s; no ack, %s", message, type(error).__name__, error, what,
                    exc_info=with_traceback)
        if not with_traceback:
            log.debug("The handler's traceback, %r", message, exc_info=True)
        message.abandon()
        return Outcome.FAILED
    message.ack()  # after the transaction committed, never inside it
    return outcome


def _run_traced(message: Message, handler: Handler, inbox: Inbox | None) -> Outcome:
    from outbox.tracing.consume import activate, handler_failed

    with activate(message.span):
        try:
            return _run(message, handler, inbox)
        except Retry:
            raise  # asked for, not a failure
        except Exception as error:
            handler_failed(message.span, error)
            raise


def _run(message: Message, handler: Handler, inbox: Inbox | None) -> Outcome:
    if inbox is None:
        handler(message)
        return Outcome.HANDLED
    with inbox.atomic():
        if not inbox.claim(message.queue, message.id):
            log.info("%r was processed before (inbox): acked without running the handler", message)
            return Outcome.SKIPPED
        handler(message)
    return Outcome.HANDLED
