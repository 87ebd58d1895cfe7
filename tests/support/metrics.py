"""Reading a process's Prometheus metrics as the tests do: the outbox_ series, by name with labels."""

from __future__ import annotations

import urllib.request


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("outbox_"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values
