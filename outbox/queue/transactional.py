"""A queue process's transactional producer: its transactions, and a new producer when one is lost.

The consumer (Start markers with its offsets) and the tracker (a redelivery with its End marker and
offsets) each write through one `TransactionalWriter`. A transaction that fails is aborted, and the
caller reads again what it was about. An error that is fatal to the producer (fenced, or its state
lost: a broker restart in the middle of a transaction can leave it so) ends that producer, not the
process: the next transaction is preceded by a new producer with the same transactional id, whose
init_transactions() fences the old one and aborts the transaction it left open at once. While Kafka
cannot start transactions the process waits, saying so once (outbox.kafka.outage). Only an error no
wait can fix (credentials, authorization) is raised.

librdkafka's send_offsets_to_transaction() waits without a limit for its coordinator request
(librdkafka issues 5456 and 5511: the request's timeout is never checked, and a coordinator that went
away while a broker restarted may never be asked for again), so one call stuck there would stop the
process for good. It is called on a thread of its own, and a call that has not returned by its
timeout plus `STUCK_GRACE` counts as fatal: that producer is abandoned (its thread stays blocked in
librdkafka) and a new one takes over.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException

from outbox.kafka.clients import KAFKA_START_TIMEOUT
from outbox.kafka.outage import Outage, fatal, permanent
from outbox.reasons import kafka_error, kafka_reason

log = logging.getLogger(__name__)
T = TypeVar("T")

#: How long past its own timeout a call into librdkafka may take before it is taken for stuck.
STUCK_GRACE = 5.0
#: A commit that fails for a reason Kafka calls retriable is tried this often before the transaction is aborted.
COMMIT_ATTEMPTS = 3

#: (function, timeout, *arguments) -> its result, or KafkaException(fatal) when it did not return in time.
Caller = Callable[..., Any]


def call_with_deadline(function: Callable[..., T], timeout: float, *args: Any) -> T:
    """`function(*args, timeout)` on a thread of its own; a fatal KafkaException when it has not returned
    `timeout + STUCK_GRACE` seconds later (the call goes on, abandoned)."""
    outcome: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append((True, function(*args, timeout)))
        except BaseException as error:  # handed to the caller's thread
            outcome.append((False, error))
        finally:
            done.set()

    threading.Thread(target=run, name=f"kafka-{getattr(function, '__name__', 'call')}", daemon=True).start()
    if not done.wait(timeout + STUCK_GRACE):
        name = getattr(function, "__name__", "a call")
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, f"{name}() did not return within "
                                        f"{timeout + STUCK_GRACE:g} s (stuck in librdkafka)", fatal=True))
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def call_at_once(function: Callable[..., T], timeout: float, *args: Any) -> T:
    """`function(*args, timeout)` on the caller's thread (the simulator's clients never block)."""
    return function(*args, timeout)


class TransactionalWriter:
    """One transactional id's producer: transactions in, a new producer after one is lost."""

    def __init__(self, build: Callable[[], Any], outage: Outage, *, timeout: float = KAFKA_START_TIMEOUT,
                 caller: Caller = call_with_deadline, transactional_id: str = "") -> None:
        """`build()`: a new producer, configured with `transactional_id` (said in the process's start line)."""
        self._build, self._outage, self._timeout, self._call = build, outage, timeout, caller
        self.transactional_id = transactional_id
        self.producer: Any = None
        self._ready = False
        #: Producers lost to a fatal error (or a stuck call) and replaced since the start.
        self.replaced = 0

    def open(self, init: Callable[[Any, float], None] | None = None) -> None:
        """The first producer and its transactions, started by `init(producer, timeout)` (its init_transactions()
        by default); raises what that raised: a process that cannot start transactions at all does not start."""
        self.producer = self._build()
        (init or (lambda producer, timeout: producer.init_transactions(timeout)))(self.producer, self._timeout)
        self._ready = True

    @property
    def lost(self) -> bool:
        """Whether the producer was lost and the next ready() builds a new one."""
        return not self._ready

    def ready(self) -> bool:
        """Whether transactions can begin: after a lost producer, a new one has started them. False (the wait
        said once) while Kafka cannot start them; raises only what no wait can fix."""
        if self._ready:
            return True
        if self.producer is None:
            self.producer = self._build()
        try:
            self.producer.init_transactions(self._timeout)
        except KafkaException as error:
            if permanent(error):
                raise
            if fatal(error):
                self.producer = None
            self._outage.waiting("Kafka to start transactions", error)
            return False
        self._ready = True
        return True

    def run(self, body: Callable[[Any], list[Any] | None], group_metadata: Callable[[], Any]) -> KafkaException | None:
        """One transaction: `body(producer)` produces and returns the offsets to commit with it (or None), which
        are sent with the group's metadata, then it commits. None when committed; else the error, with the
        transaction aborted or its producer given up (the next ready() replaces it). Raises only what no wait
        can fix, and what `body` raises that is not Kafka's."""
        producer = self.producer
        try:
            producer.begin_transaction()
            offsets = body(producer)
            if offsets:
                self._call(producer.send_offsets_to_transaction, self._timeout, offsets, group_metadata())
            self._commit(producer)
        except KafkaException as error:
            if permanent(error):
                raise
            self._abort(producer, error)
            self._outage.waiting("Kafka to commit transactions", error)
            return error
        self._outage.resumed()
        return None

    def _commit(self, producer: Any) -> None:
        for attempt in range(COMMIT_ATTEMPTS):
            try:
                producer.commit_transaction(self._timeout)
                return
            except KafkaException as error:
                kerror = kafka_error(error)
                if kerror is None or not kerror.retriable() or kerror.fatal() or attempt == COMMIT_ATTEMPTS - 1:
                    raise

    def _abort(self, producer: Any, error: KafkaException) -> None:
        if fatal(error):
            self._give_up(error)
            return
        try:
            producer.abort_transaction(self._timeout)
        except KafkaException as abort_error:
            if permanent(abort_error):
                raise
            if fatal(abort_error):
                self._give_up(abort_error)
            else:
                log.debug("Aborting a transaction: %s", kafka_reason(abort_error))

    def _give_up(self, error: KafkaException) -> None:
        """The producer is done for (a fatal error): the next ready() builds another with the same id."""
        log.warning("%s: its transactional producer failed for good (%s); a new one with the same transactional id "
                    "takes over, aborting what the old one left open", self._outage.who, kafka_reason(error))
        self.producer = None
        self._ready = False
        self.replaced += 1
