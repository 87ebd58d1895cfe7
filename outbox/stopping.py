"""SIGTERM and SIGINT as a request to stop, for every long-running command (harvest, the queue's
consumer and tracker, the pipeline's follow mode): finish what is in hand, then exit. SIGUSR1 prints every
thread's Python stack to stderr and changes nothing, so a command that seems stuck can say where it waits."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("outbox")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: Prints every thread's stack (faulthandler) while a command runs.
STACKS_SIGNAL = signal.SIGUSR1


@contextlib.contextmanager
def on_stop_signals(stop: Callable[[], None]) -> Iterator[None]:
    """While the block runs, SIGTERM and SIGINT call `stop` (logged) and SIGUSR1 prints every thread's stack to
    stderr; the previous handlers come back after.

    Outside the main thread (signals cannot be handled there) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def request_stop(signum: int, _frame: Any) -> None:
        log.info("%s received: stopping", signal.Signals(signum).name)
        stop()

    previous = {sig: signal.signal(sig, request_stop) for sig in STOP_SIGNALS}
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    try:
        yield
    finally:
        faulthandler.unregister(STACKS_SIGNAL)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
