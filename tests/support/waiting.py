"""The one way tests wait for something another thread or process does: a condition, with a deadline.

A test never sleeps a fixed time to let something happen (or not happen): it waits for the condition, or,
to prove an absence, for progress that would have shown it (a number of polls or turns).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """`condition()`'s first true value, asked every `interval` seconds; AssertionError naming `what` after
    `timeout` seconds (a liveness bound, generous: it is never what a test measures)."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)
