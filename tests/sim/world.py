"""The simulated world: one clock, one queue of events, one random generator, all from a seed.

Nothing in a simulated run reads the wall clock or iterates a set of strings, so a seed replays
the same run, fault for fault, in any process.
"""

from __future__ import annotations

import heapq
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field


class Violation(AssertionError):
    """An invariant broke; the message says which, with the simulated time and what was seen."""


@dataclass(order=True)
class _Event:
    time: float
    seq: int
    action: Callable[[], None] = field(compare=False)


class World:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.now = 0.0
        self._queue: list[_Event] = []
        self._seq = 0
        self.trace: list[str] = []
        self.keep_trace = False

    def at(self, time: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._queue, _Event(max(time, self.now), self._seq, action))

    def after(self, delay: float, action: Callable[[], None]) -> None:
        self.at(self.now + delay, action)

    def run_until(self, end: float, done: Callable[[], bool] | None = None) -> None:
        queue = self._queue
        while queue and queue[0].time <= end:
            event = heapq.heappop(queue)
            self.now = event.time
            event.action()
            if done is not None and done():
                return
        self.now = max(self.now, end) if not queue or queue[0].time > end else self.now

    def uuid(self) -> uuid.UUID:
        return uuid.UUID(int=self.rng.getrandbits(128), version=4)

    def chance(self, p: float) -> bool:
        return p > 0 and self.rng.random() < p

    def latency(self, low: float, high: float) -> float:
        return self.rng.uniform(low, high)

    def note(self, text: str) -> None:
        if self.keep_trace:
            self.trace.append(f"{self.now:9.4f} {text}")
