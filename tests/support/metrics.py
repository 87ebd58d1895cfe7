"""Reading a process's Prometheus metrics as the tests do: the outbox_ series, by name with labels."""

from __future__ import annotations

import urllib.error
import urllib.request


def scrape(port: int) -> dict[str, float]:
    """The outbox_ series on `port`; none while nothing listens there yet (a process serves its metrics once it
    started, a moment after its status row appears): a wait on a series asks again, an assertion fails on it."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except urllib.error.URLError as error:
        if isinstance(error.reason, ConnectionRefusedError):
            return {}
        raise
    values = {}
    for line in text.splitlines():
        if line.startswith("outbox_"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values
