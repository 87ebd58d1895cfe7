"""SIGTERM and SIGINT as a request to stop, for every long-running command (harvest, the queue's
consumer and tracker, the pipeline's follow mode): finish what is in hand, then exit."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("outbox")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def on_stop_signals(stop: Callable[[], None]) -> Iterator[None]:
    """While the block runs, SIGTERM and SIGINT call `stop` (logged); the previous handlers come back after.

    Outside the main thread (signals cannot be handled there) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def request_stop(signum: int, _frame: Any) -> None:
        log.info("%s received: stopping", signal.Signals(signum).name)
        stop()

    previous = {sig: signal.signal(sig, request_stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
