"""What each topic accepts: its `max.message.bytes`, learned from the brokers and refreshed, and the sizes
of records and batches measured against it.

A topic's `max.message.bytes` bounds a whole record batch, not one record. A producer that batches
past it has every such batch refused; with idempotence and the gapless guarantee that is a fatal
error, so the harvester would replace its producer and give up everything in flight, again and
again, and every key would stall (not just an oversized record's). So the limit is learned before
a topic's first record is produced: the record producer's `batch.size` fits the smallest limit it
sends to, and a record that could not fit even alone is held, with an error naming the limit,
without being produced.

The sizes are Kafka's record format v2 (KIP-98): a batch header of 61 bytes, then per record its
length, attributes, timestamp and offset deltas, key, value and headers, lengths as zigzag varints.
They are uncompressed sizes: with compression a record may fit that this holds back, as librdkafka's
own `message.max.bytes` check at produce() does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from confluent_kafka import KafkaError, KafkaException

from outbox.kafka.clients import Describe
from outbox.kafka.sizes import UNLIMITED, bytes_text
from outbox.reasons import kafka_code, kafka_reason

log = logging.getLogger("outbox.harvest")

#: An unknown topic (not created yet: the first record creates it, where the brokers allow that) is
#: asked about again this soon.
UNKNOWN_TOPIC_RETRY = 2.0
#: When the brokers keep failing to answer for a topic's configuration this long, its records go out
#: unchecked (the broker still refuses a batch over the limit) rather than waiting for ever.
GIVE_UP_AFTER = 10.0
#: Errors that say the configuration cannot be read at all (no DescribeConfigs permission).
_NOT_ALLOWED = frozenset({KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED,
                          KafkaError.INVALID_REQUEST, KafkaError.UNSUPPORTED_VERSION})



#: A record over its topic's limit read longer ago than this (seconds) waits for the limit to be read again, at most
#: this long, before it is held for its size (TopicLimits.stale).
RECHECK_AGE = 5.0


class TopicLimits:
    """Each topic's max.message.bytes as last read from the brokers; thread-safe.

    `limit(topic)` answers at once: the bytes, or None while the topic has not been read yet (it is
    asked for; `learn()`, run by a thread of the runtime or by a test, reads it). Every topic is read
    again every `refresh_interval` seconds, and at once after `invalidate()` (a batch was refused for
    its size: the limit must have been lowered).
    """

    def __init__(self, describe: Describe, *, refresh_interval: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._describe = describe
        self.refresh_interval = refresh_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._known: dict[str, int] = {}
        self._due: dict[str, float] = {}  # topic -> when to read it (again)
        self._asked: dict[str, float] = {}  # topic -> when it was first asked for, while unknown
        self._warned: set[str] = set()
        self._read_at: dict[str, float] = {}  # topic -> when its limit was last read
        self._rechecked: dict[str, float] = {}  # topic -> when stale() last asked for it again
        self.changed = threading.Event()  # set when a topic is asked for or due: the learning thread wakes

    def limit(self, topic: str) -> int | None:
        known = self._known.get(topic)
        if known is not None:
            return known
        with self._lock:
            if topic not in self._asked:
                self._asked[topic] = self._clock()
                self._due[topic] = 0.0
                self.changed.set()
        return None

    def invalidate(self, topic: str | None = None) -> None:
        """Read `topic` (every topic, if None) again at the next learn()."""
        with self._lock:
            for name in [topic] if topic is not None else list(self._due):
                if name in self._due:
                    self._due[name] = 0.0
            self.changed.set()

    def stale(self, topic: str, max_age: float | None = None) -> bool:
        """Whether a record over `topic`'s limit should wait for the limit to be read again before it is held for
        its size: the limit was read more than `max_age` ago (an operator may have raised it, and retried the held
        record). Asks for it at once, at most once per read, and is waited for at most `max_age`: a topic whose
        limit cannot be read holds its record as before."""
        max_age = RECHECK_AGE if max_age is None else max_age
        now = self._clock()
        with self._lock:
            read_at = self._read_at.get(topic)
            if read_at is None:
                return False
            asked = self._rechecked.get(topic)
            if asked is not None and asked > read_at:  # asked, not read yet
                return now - asked < max_age
            if now - read_at <= max_age:
                return False
            self._rechecked[topic] = now
            self._due[topic] = 0.0
            self.changed.set()
            return True

    def snapshot(self) -> dict[str, int]:
        """What is known now (UNLIMITED: could not be read)."""
        return dict(self._known)

    def next_due(self) -> float:
        with self._lock:
            return min(self._due.values(), default=float("inf"))

    def learn(self) -> None:
        """Read the limits of the topics that are due (one request for all of them)."""
        now = self._clock()
        with self._lock:
            self.changed.clear()
            due = sorted(topic for topic, when in self._due.items() if when <= now)
        if not due:
            return
        try:
            answers: Mapping[str, int | BaseException] = self._describe(due)
        except Exception as error:  # the brokers cannot be asked at all: every topic failed alike
            answers = {topic: error for topic in due}
        for topic in due:
            self._take(topic, answers.get(topic, KafkaException(KafkaError(KafkaError._TIMED_OUT))), now)

    def _take(self, topic: str, answer: int | BaseException, now: float) -> None:
        previous = self._known.get(topic)
        if isinstance(answer, int):
            self._settle(topic, answer, now + self.refresh_interval)
            with self._lock:
                self._read_at[topic] = now
            if previous not in (None, UNLIMITED) and previous != answer:
                log.warning("Topic %s: max.message.bytes changed from %s to %s bytes", topic,
                            bytes_text(previous), bytes_text(answer))
            elif previous != answer:  # first read, or first since it was created or became readable
                log.debug("Topic %s: max.message.bytes is %s bytes", topic, bytes_text(answer))
            return
        code = kafka_code(answer)
        if code == KafkaError.UNKNOWN_TOPIC_OR_PART:
            # Not created yet: its first record may create it (with the brokers' default limit).
            self._settle(topic, previous or UNLIMITED, now + UNKNOWN_TOPIC_RETRY)
            return
        if code in _NOT_ALLOWED:
            self._settle(topic, UNLIMITED, now + self.refresh_interval)
            self._warn(topic, f"cannot read topic {topic}'s max.message.bytes ({kafka_reason(answer)}): a record over "
                              f"it will be refused by the broker rather than held before it is produced (grant "
                              f"DescribeConfigs on the topic)")
            return
        # The brokers did not answer: keep what was known; an unknown topic waits, then goes out unchecked.
        with self._lock:
            asked = self._asked.get(topic, now)
        if previous is not None:
            self._settle(topic, previous, now + min(self.refresh_interval, UNKNOWN_TOPIC_RETRY))
        elif now - asked >= GIVE_UP_AFTER:
            self._settle(topic, UNLIMITED, now + UNKNOWN_TOPIC_RETRY)
            self._warn(topic, f"cannot read topic {topic}'s max.message.bytes ({kafka_reason(answer)}): its records "
                              f"go out unchecked until it can be read")
        else:
            with self._lock:
                self._due[topic] = now + min(1.0, self.refresh_interval)

    def _settle(self, topic: str, limit: int, due: float) -> None:
        with self._lock:
            self._known[topic] = limit
            self._due[topic] = due
            self._asked.pop(topic, None)

    def _warn(self, topic: str, message: str) -> None:
        if topic not in self._warned:
            self._warned.add(topic)
            log.warning("%s", message)


class TopicLimitsThread(threading.Thread):
    """Runs TopicLimits.learn() when a topic is asked for or due, until stopped."""

    def __init__(self, limits: TopicLimits) -> None:
        super().__init__(name="outbox-topics", daemon=True)
        self.limits = limits
        self._stop_event = threading.Event()
        self.failure: BaseException | None = None

    def stop(self) -> None:
        self._stop_event.set()
        self.limits.changed.set()

    def run(self) -> None:
        limits = self.limits
        try:
            while not self._stop_event.is_set():
                limits.learn()
                wait = min(1.0, max(0.0, limits.next_due() - time.monotonic()))
                limits.changed.wait(wait)
        except BaseException as error:  # the harvester notices and stops as a whole
            self.failure = error
            log.exception("Topic limits thread failed")


