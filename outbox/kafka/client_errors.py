"""librdkafka's error callback for every Kafka client of ours (the harvester's and the queues'), in one place.

librdkafka reports transient broker trouble here and retries by itself; only fatal errors need us. While
a broker is down every client reports each failed connection again, about once a second, here and in
librdkafka's own log line of it: the same error (its durations aside) is logged once a minute, its repeats at
DEBUG.
"""

from __future__ import annotations

import logging
import re
import threading
import time

from confluent_kafka import KafkaError

log = logging.getLogger("outbox.harvest.kafka")
#: The same error is logged at its level again after this long; in between, its repeats go to DEBUG.
REPEAT_AFTER = 60.0
_DURATIONS = re.compile(r"\d+ ?ms")  # "(after 0ms in state CONNECT)", "after 10002 ms"
_last_logged: dict[str, float] = {}
_lock = threading.Lock()
_clock = time.monotonic


def said_lately(text: str) -> bool:
    """Whether the same transient error (its durations aside) was said in the last REPEAT_AFTER seconds, by this
    callback or by librdkafka's own log line of it (clients.py); if not, it counts as said now."""
    key, now = _DURATIONS.sub("", text), _clock()
    with _lock:
        if now - _last_logged.get(key, -REPEAT_AFTER) < REPEAT_AFTER:
            return True
        _last_logged[key] = now
        return False


def log_client_error(error: KafkaError) -> None:
    """librdkafka's error_cb for every client of ours: fatal errors logged as errors, the rest as warnings."""
    text = error.str()
    level = logging.ERROR if error.fatal() else logging.DEBUG if said_lately(text) else logging.WARNING
    log.log(level, "Kafka client: %s", text)
