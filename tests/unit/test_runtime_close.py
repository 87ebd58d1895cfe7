"""ThreadedIO.close(), the end of every harvester's stop: the database workers end before the other threads are
asked to (their last purge is done before the group is left), and threads that never end hold it for one
THREADS_STOP_TIMEOUT together, not one each (five in a row made a stop on SIGTERM take over a minute)."""

from __future__ import annotations

import threading
import time

from outbox.harvest import runtime
from outbox.harvest.config import HarvestConfig


class Thread(threading.Thread):
    """A runtime thread's stop() and run(): it ends once asked to, or (stuck) never."""

    def __init__(self, log: list[tuple[str, str]], name: str, *, stuck: threading.Event | None = None) -> None:
        super().__init__(name=name, daemon=True)
        self.log, self.stuck = log, stuck
        self.asked = threading.Event()

    def stop(self) -> None:
        self.log.append(("asked", self.name))
        self.asked.set()

    def run(self) -> None:
        self.asked.wait()
        if self.stuck is not None:
            self.stuck.wait()  # a call into a client that returns only once the test has measured the close
        self.log.append(("ended", self.name))


def closing(monkeypatch, *, stuck: bool) -> tuple[list[tuple[str, str]], float]:
    monkeypatch.setattr(runtime, "THREADS_STOP_TIMEOUT", 1.0)
    io = runtime.ThreadedIO(HarvestConfig(dsn="dbname=x"), None, time.monotonic, lambda event: None)
    log: list[tuple[str, str]] = []
    released = threading.Event()
    io._workers = {name: Thread(log, name) for name in ("outbox-fence", "outbox-purge")}
    io._election, io._keeper, io._poller, io._topics = (Thread(log, name, stuck=released if stuck else None)
                                                        for name in ("outbox-election", "outbox-partitions",
                                                                     "outbox-delivery", "outbox-topics"))
    for thread in (*io._workers.values(), io._election, io._keeper, io._poller, io._topics):
        thread.start()
    began = time.monotonic()
    try:
        io.close()
        return log, time.monotonic() - began
    finally:
        released.set()


def test_the_database_workers_end_before_the_others_are_asked_to_stop(monkeypatch):
    log, _ = closing(monkeypatch, stuck=False)
    first_other = log.index(("asked", "outbox-election"))
    assert {("ended", "outbox-fence"), ("ended", "outbox-purge")} <= set(log[:first_other]), log
    assert {entry for entry in log if entry[0] == "ended"} == {("ended", name) for name in (
        "outbox-fence", "outbox-purge", "outbox-election", "outbox-partitions", "outbox-delivery", "outbox-topics")}


def test_threads_that_never_end_hold_the_close_once_together_not_once_each(monkeypatch):
    log, took = closing(monkeypatch, stuck=True)
    # Four stuck threads: one wait of 1 s for all of them (one after the other, 4 s).
    assert took < 3.0, f"close() took {took:.1f} s"
    assert {name for kind, name in log if kind == "asked"} >= {"outbox-election", "outbox-delivery", "outbox-topics"}
