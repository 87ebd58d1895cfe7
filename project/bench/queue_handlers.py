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


def noop_counted(message: Message) -> None:
    """Does nothing but append "<epoch time>" to $BENCH_EVENTS (one line per message), so the benchmark sees the
    last message handled on a backend without a markers topic to read the acks from."""
    global _counted
    if _counted is None:
        _counted = open(os.environ["BENCH_EVENTS"], "a", buffering=1)  # noqa: SIM115 - kept for the process's life
    _counted.write(f"{time.time()}\n")
