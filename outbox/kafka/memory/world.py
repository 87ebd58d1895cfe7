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
    """The clock and the event queue; subclasses say how time passes (`now`) and how long things take."""

    #: The clock: an attribute the simulated world moves (read millions of times a run), the wall clock's property.
    now: float

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self._queue: list[_Event] = []
        self._seq = 0
        self.trace: list[str] = []
        self.keep_trace = False

    def at(self, when: float, action: Callable[[], None]) -> None:
        self._seq += 1
        now = self.now
        heapq.heappush(self._queue, (when if when > now else now, self._seq, action))

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
        self.now = 0.0

    def run_until(self, end: float, done: Callable[[], bool] | None = None) -> None:
        queue, pop = self._queue, heapq.heappop
        while queue and queue[0][0] <= end:
            self.now, _, action = pop(queue)
            action()
            if done is not None and done():
                return
        self.now = max(self.now, end) if not queue or queue[0][0] > end else self.now


class LiveWorld(World):
    """The wall clock. Actions run in `run_due()`, under `lock`, which every client holds while it calls in."""

    def __init__(self) -> None:
        super().__init__(random.Random())
        self.lock = threading.RLock()

    @property  # type: ignore[override]
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
