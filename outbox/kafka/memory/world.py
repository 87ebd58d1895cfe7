"""Time, scheduled actions and chance for the in-memory table and broker.

`SimWorld`: one simulated clock, one queue of events and one random generator, all from a seed.
Nothing in a simulated run reads the wall clock or iterates a set of strings, so a seed replays the
same run, fault for fault, in any process.

`LiveWorld`: the wall clock, for the fakes: no latency, no faults unless a test turns them on, and
scheduled actions run when a client calls in (as librdkafka serves callbacks inside poll()).
"""

from __future__ import annotations

import heapq
import random
import threading
import time
import uuid
from collections.abc import Callable


class Violation(AssertionError):
    """An invariant broke; the message says which, with the simulated time and what was seen."""


#: A scheduled action: (time, sequence number, action), ordered by time, then by scheduling order.
_Event = tuple[float, int, Callable[[], None]]


class World:
    """The clock and the event queue; subclasses say how time passes and how long things take."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self._queue: list[_Event] = []
        self._seq = 0
        self.trace: list[str] = []
        self.keep_trace = False

    @property
    def now(self) -> float:
        raise NotImplementedError

    def at(self, when: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (max(when, self.now), self._seq, action))

    def after(self, delay: float, action: Callable[[], None]) -> None:
        self.at(self.now + delay, action)

    def uuid(self) -> uuid.UUID:
        return uuid.UUID(int=self.rng.getrandbits(128), version=4)

    def chance(self, p: float) -> bool:
        return p > 0 and self.rng.random() < p

    def latency(self, low: float, high: float) -> float:
        return self.rng.uniform(low, high)

    def note(self, text: str) -> None:
        if self.keep_trace:
            self.trace.append(f"{self.now:9.4f} {text}")


class SimWorld(World):
    """A seeded run: time moves only from event to event."""

    def __init__(self, seed: int) -> None:
        super().__init__(random.Random(seed))
        self.seed = seed
        self._now = 0.0

    @property
    def now(self) -> float:
        return self._now

    def run_until(self, end: float, done: Callable[[], bool] | None = None) -> None:
        queue = self._queue
        while queue and queue[0][0] <= end:
            self._now, _, action = heapq.heappop(queue)
            action()
            if done is not None and done():
                return
        self._now = max(self._now, end) if not queue or queue[0][0] > end else self._now


class LiveWorld(World):
    """The wall clock. Actions run in `run_due()`, under `lock`, which every client holds while it calls in."""

    def __init__(self) -> None:
        super().__init__(random.Random())
        self.lock = threading.RLock()

    @property
    def now(self) -> float:
        return time.monotonic()

    def latency(self, low: float, high: float) -> float:
        return 0.0

    def uuid(self) -> uuid.UUID:
        return uuid.uuid4()

    def run_due(self) -> None:
        """Run every action whose time has come, including those that these schedule for now."""
        with self.lock:
            queue = self._queue
            while queue and queue[0][0] <= self.now:
                heapq.heappop(queue)[2]()
