"""Handlers for `manage.py outbox_consume` in the queue tests; each appends what it did to $QUEUE_TEST_LOG.

Lines: "<event> <queue> <message id> <delivery> <pid>", written with O_APPEND so processes never mix them.
"""

from __future__ import annotations

import os
import signal
import time

from django.db import transaction

from outbox.queue import Message, Retry
from project.shop.models import Order


def _log(event: str, message: Message) -> None:
    line = f"{event} {message.queue} {message.id} {message.deliveries} {os.getpid()}\n"
    with open(os.environ["QUEUE_TEST_LOG"], "a") as log:
        log.write(line)


def record(message: Message) -> None:
    """$QUEUE_TEST_MODE: "quick"; "sleep:S" (first deliveries take S seconds); "flaky" (some fail once)."""
    mode = os.environ.get("QUEUE_TEST_MODE", "quick")
    _log("start", message)
    if mode.startswith("sleep:") and message.deliveries == 1:
        time.sleep(float(mode.removeprefix("sleep:")))
    if mode == "flaky" and message.deliveries == 1:
        bucket = int(message.id[:8], 16)
        if bucket % 3 == 0:
            _log("fail", message)
            raise RuntimeError("flaky handler: fails on the first delivery")
        if bucket % 5 == 0:
            _log("retry", message)
            raise Retry("flaky handler: asks for a retry on the first delivery")
    _log("done", message)


def order_then_crash(message: Message) -> None:
    """Creates an order named by the message; on a first delivery the process dies right after the commit."""
    Order.objects.create(item=message.id[:100])
    _log("ran", message)
    if message.deliveries == 1:
        transaction.on_commit(lambda: os.kill(os.getpid(), signal.SIGKILL))


def order(message: Message) -> None:
    """Creates an order named by the message (with --inbox: in the inbox's transaction, so exactly once)."""
    Order.objects.create(item=message.id[:100])
    _log("done", message)
