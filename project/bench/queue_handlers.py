"""Handlers for `manage.py queue_bench`'s consumers."""

from __future__ import annotations

import os
import time

from outbox.queue import Message


def noop(message: Message) -> None:
    """Does nothing: the benchmark measures the queue, not the work."""


def hang_in_victim(message: Message) -> None:
    """In the process started with BENCH_VICTIM=1, hang on a first delivery (until SIGKILL); elsewhere do nothing.

    Writes "<event> <message id> <monotonic time>" lines to $BENCH_EVENTS.
    """
    victim = os.environ.get("BENCH_VICTIM") == "1" and message.deliveries == 1
    with open(os.environ["BENCH_EVENTS"], "a") as events:
        events.write(f"{'hang' if victim else 'done'} {message.id} {time.monotonic()}\n")
    if victim:
        time.sleep(3600)


_counted = None
_sleep = float(os.environ.get("BENCH_HANDLER_MS") or 0) / 1000


def counted(message: Message) -> None:
    """Sleeps $BENCH_HANDLER_MS milliseconds (none when unset or 0: a no-op), then appends "<epoch time>" to
    $BENCH_EVENTS (one line per message), so the benchmark sees the last message handled whichever the backend
    (the share backend has no markers topic to read the acks from)."""
    global _counted
    if _sleep:
        time.sleep(_sleep)
    if _counted is None:
        _counted = open(os.environ["BENCH_EVENTS"], "a", buffering=1)  # noqa: SIM115 - kept for the process's life
    _counted.write(f"{time.time()}\n")
