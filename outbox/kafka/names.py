"""Names the outbox gives and checks: Kafka's rule for topic names, and the names of processes (a replica, a queue
consumer), which show up in every log line, client id and status row."""

from __future__ import annotations

import os
import re
import socket
import time

# Kafka's own rule for topic names: 1..249 of [a-zA-Z0-9._-], and not "." or "..".
TOPIC_PATTERN = re.compile(r"[a-zA-Z0-9._-]{1,249}")
MAX_TOPIC_LENGTH = 249
# Control characters (C0, DEL, C1) and the Unicode line and paragraph separators: a name carrying
# one could forge a line in every log that quotes it.
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


#: Why a value is not a topic name, as the settings' checks say it ("..., got <value>" follows).
TOPIC_NAME = f"must be a Kafka topic name (1-{MAX_TOPIC_LENGTH} of a-z A-Z 0-9 . _ -)"


def is_topic_name(value: object) -> bool:
    """Kafka's rule for topic names: 1-249 of a-z A-Z 0-9 . _ -, and not "." or ".."."""
    return isinstance(value, str) and TOPIC_PATTERN.fullmatch(value) is not None and value not in {".", ".."}


def default_name() -> str:
    """A replica name that is unique enough: host, pid and start second (as goharvest)."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname() or "localhost")
    return f"{host}_{os.getpid()}_{int(time.time())}"


def name_problem(value: object) -> str | None:
    """Why `value` cannot name a replica or a group (it shows up in every log line and status row), or None."""
    if not isinstance(value, str) or not value.strip():
        return f"must be a non-empty string, got {value!r}"
    if CONTROL_CHARACTERS.search(value):
        return f"must not contain control characters (a line break would forge a log line), got {value!r}"
    return None
