"""The wait behind both consumers' receive() (consumer.py's markers backend, share_consumer.py's share
groups): each buffers deliveries in a state object from its I/O thread and hands them out here."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol


class Buffer(Protocol):
    def take(self, now: float) -> Any | None:
        """The next delivery to hand out, if any."""


def wait_for_delivery(changed: threading.Condition, buffer: Buffer, clock: Callable[[], float],
                      stopping: threading.Event, raise_failure: Callable[[], None],
                      timeout: float | None) -> Any | None:
    """The next delivery `buffer` hands out, waiting on `changed` up to `timeout` seconds (None: forever, until
    `stopping`); None if none came. `raise_failure` raises what the I/O thread failed with, if it did."""
    deadline = None if timeout is None else clock() + timeout
    with changed:
        while True:
            raise_failure()
            delivery = buffer.take(clock())
            if delivery is not None:
                return delivery
            wait = 0.5 if deadline is None else min(0.5, deadline - clock())
            if wait <= 0 or stopping.is_set():
                return None
            changed.wait(wait)
