"""Wake pipes: how one thread ends another's wait on its descriptors (the engine's, the LISTEN hub's).

A thread that waits in poll() on sockets (the LISTEN session) and on work handed over by other threads
selects on the read end of a pipe; the others write a byte to wake it. Both ends are non-blocking: a full
pipe already holds a pending wake, and a waiter drains every byte at once.
"""

from __future__ import annotations

import math
import os
import select


class WakePipe:
    """A non-blocking pipe whose bytes are wakes. The owner closes it once no other thread can still wake it
    (a write to a closed descriptor number could reach a file opened since)."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def fileno(self) -> int:
        """The end to select on (-1 once closed)."""
        return self._read

    def wake(self) -> None:
        if self._write < 0:
            return
        try:
            os.write(self._write, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake is pending) or closed

    def drain(self) -> int:
        """Read the pipe empty; returns how many wakes it held."""
        count = 0
        try:
            while chunk := os.read(self._read, 4096):
                count += len(chunk)
        except (BlockingIOError, OSError):
            pass
        return count

    def close(self) -> None:
        fds, (self._read, self._write) = (self._read, self._write), (-1, -1)
        for fd in fds:
            if fd >= 0:
                os.close(fd)


def readable(fds: list[int], timeout: float | None) -> set[int]:
    """The descriptors of `fds` ready to read (or closed) within `timeout` seconds (None: no limit). poll(),
    not select(): a process harvesting many outboxes has descriptors past select()'s 1024."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return {fd for fd, _events in poller.poll(None if timeout is None else math.ceil(timeout * 1000))}
