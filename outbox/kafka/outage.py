"""What a long-running process does and says while Kafka (or its database) is away.

A process rides through an outage rather than ending: it says in one line what it waits for (and
Kafka's reason) when it starts waiting, in one line when it resumes (after how long), and says how
long it has been waiting to whoever asks (its status row, its metrics, its health probe), so a
live process that stalls is seen. Only what no restart can fix ends it: `permanent()`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from outbox.kafka.client_errors import log_client_error
from outbox.reasons import first_line, kafka_error, kafka_reason

#: While waiting with nothing else to try, whether Kafka answers again is asked this often.
PROBE_INTERVAL = 1.0

#: Errors no wait can fix: the client's credentials, its trust in the brokers' certificates, or its
#: permissions are wrong. A process that meets one ends, saying so in one line.
PERMANENT_CODES = frozenset({
    KafkaError._AUTHENTICATION, KafkaError.SASL_AUTHENTICATION_FAILED, KafkaError._SSL,
    KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED, KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
})


def permanent(error: BaseException) -> bool:
    """Whether waiting cannot fix `error` (a Kafka error with one of PERMANENT_CODES)."""
    found = kafka_error(error) if isinstance(error, KafkaException) else None
    return found is not None and found.code() in PERMANENT_CODES


def fatal(error: BaseException) -> bool:
    """Whether `error` ended the client that raised it (librdkafka's fatal errors): that client must be
    rebuilt, though the process goes on."""
    found = kafka_error(error) if isinstance(error, KafkaException) else None
    return found is not None and found.fatal()


class Outage:
    """One thing a process may wait for (Kafka's transactions, the markers topic, its database).

    `waiting()` on each failed attempt logs the first one only; `resumed()` on a success logs the
    end of a wait only; any thread may call either (librdkafka's error callbacks among them).
    """

    def __init__(self, logger: logging.Logger, who: str, clock: Callable[[], float] = time.monotonic, *,
                 stall_after: float | None = None) -> None:
        """`stall_after`: a wait longer than this is said once more, as a stall (nothing is handled meanwhile)."""
        self._log, self.who, self._clock, self.stall_after = logger, who, clock, stall_after
        self._stall_said = False
        #: When the wait began (the process's clock), None while not waiting.
        self.since: float | None = None
        #: What is waited for, and the reason the last attempt gave.
        self.what = ""
        self.reason = ""
        self._next_probe = 0.0
        self._lock = threading.Lock()

    def waiting(self, what: str, error: BaseException | str) -> None:
        """An attempt failed for a reason a wait may fix."""
        reason = kafka_reason(error) if isinstance(error, BaseException) else first_line(error)
        with self._lock:
            self.reason = reason
            if self.since is not None:
                waiting = False
            else:
                waiting, self.since, self.what, self._stall_said = True, self._clock(), what, False
        if waiting:
            self._log.warning("%s: waiting for %s (%s)", self.who, what, reason)
        else:
            self.stalled()

    def resumed(self) -> None:
        """An attempt succeeded: the wait, if any, is over."""
        with self._lock:
            since, self.since = self.since, None
        if since is not None:
            self._log.info("%s: resumed after %.1f s waiting for %s", self.who, self._clock() - since, self.what)

    def stalled(self) -> bool:
        """Whether the wait has lasted past `stall_after`; said once per wait, the first time it is asked."""
        waited = self.waited()
        if self.stall_after is None or waited <= self.stall_after:
            return False
        if not self._stall_said:
            self._stall_said = True
            self._log.warning("%s: still waiting for %s after %.0f s (%s): nothing is handled meanwhile", self.who,
                              self.what, waited, self.reason)
        return True

    def client_error(self, error: KafkaError) -> None:
        """librdkafka's error_cb for the process's clients: every broker down is a wait (said once), and each
        error is logged as every client's are."""
        if error.code() == KafkaError._ALL_BROKERS_DOWN:
            self.waiting("Kafka's brokers", error.str())
        log_client_error(error)

    def watch(self, config: dict[str, Any]) -> dict[str, Any]:
        """A client's settings with this outage's error callback (unless the application set its own). Only a
        client polled all the time is watched (a group's consumer, a producer polled by a thread of its own): the
        others' callbacks come when they are next polled, which may be long after the wait ended."""
        if config.get("error_cb") in (None, log_client_error):
            return {**config, "error_cb": self.client_error}
        return config

    def probe(self, ask: Callable[[float], object]) -> None:
        """While waiting, with nothing else that would tell: `ask(timeout)` a broker a question (at most once
        every PROBE_INTERVAL); an answer ends the wait, an error keeps it."""
        if self.since is None or self._clock() < self._next_probe:
            return
        self._next_probe = self._clock() + PROBE_INTERVAL
        try:
            ask(PROBE_INTERVAL)
        except KafkaException as error:
            self._log.debug("%s: Kafka does not answer yet: %s", self.who, kafka_reason(error))
            self.stalled()
            return
        self.resumed()

    def waited(self) -> float:
        """Seconds waited so far (0 while not waiting)."""
        since = self.since
        return 0.0 if since is None else max(0.0, self._clock() - since)
