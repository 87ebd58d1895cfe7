"""Fast NELI leader election over Kafka, as goneli: whoever owns partition 0 of the leader topic leads.

This is the election's I/O only; what it means is decided by the core (core.py). Kafka's group
coordinator assigns partition 0 to one consumer of the group. That alone is not safe across a
network partition: the coordinator may hand the partition to another replica before this one's
rebalance callback runs. So the owner also publishes a heartbeat to the leader topic every poll and
reads it back; the core fences itself when it has seen none of its own for `heartbeat_timeout`,
well before Kafka's session timeout (three heartbeat timeouts) could give the partition away.

`ElectionPoll` is what the election thread does each poll, as a step: the real thread
(runtime.ElectionThread) runs it every `min_poll_interval`, and the simulator (tests/sim) runs the
very same step on its clock, over its model of the leader topic.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from operator import methodcaller
from typing import Any, Protocol

from confluent_kafka import KafkaError, KafkaException

from outbox.harvest.config import MIN_HEARTBEAT_TIMEOUT
from outbox.harvest.kafka import ConsumerLike, ProducerLike
from outbox.kafka.clients import KafkaUnavailable

log = logging.getLogger(__name__)


class LeaderElection:
    """The leader topic's consumer (whose ownership of partition 0 elects) and heartbeat producer."""

    def __init__(self, topic: str, name: str, consumer: ConsumerLike, producer: ProducerLike,
                 max_age: float | None = None, clock: Callable[[], int] = time.time_ns) -> None:
        self._topic = topic
        #: Wall-clock nanoseconds, as heartbeats carry them (the simulator's clock in its runs).
        self._clock = clock
        #: A heartbeat sent longer ago than this counts for nothing (a replica resuming from a pause must not
        #: lead again on one it sent before).
        self._max_age_ns = None if max_age is None else int(max_age * 1e9)
        self._consumer = consumer
        self._producer = producer
        # Heartbeats carry this replica's name and a random incarnation, so a replica only ever
        # counts its own heartbeats, even if another runs with the same name.
        self._signature = f"%{name}%{uuid.uuid4().hex}".encode()
        self._closed = False

    def start(self, on_assigned: Callable[[], None], on_revoked: Callable[[], None],
              on_lost: Callable[[], None]) -> None:
        """Join the group; the callbacks run inside poll(), when partition 0 comes or goes."""

        def assigned(_consumer: Any, partitions: list[Any]) -> None:
            if any(p.partition == 0 for p in partitions):
                on_assigned()

        def revoked(_consumer: Any, partitions: list[Any]) -> None:
            if any(p.partition == 0 for p in partitions):
                on_revoked()

        def lost(_consumer: Any, partitions: list[Any]) -> None:
            if any(p.partition == 0 for p in partitions):
                on_lost()

        self._consumer.subscribe([self._topic], on_assign=assigned, on_revoke=revoked, on_lost=lost)

    def poll(self, *, heartbeat: bool) -> bool:
        """Read the leader topic (rebalance callbacks run in here); True if an own heartbeat came back.
        With `heartbeat`, publish the next one."""
        seen = False
        for message in self._consumer.consume(num_messages=256, timeout=0):
            error = message.error()
            if error is not None:
                leader_topic_error(error)
            elif message.partition() == 0 and self._fresh_own(message.value() or b""):
                seen = True
        if heartbeat:
            self._heartbeat()
        self._producer.poll(0)
        return seen

    def _fresh_own(self, value: bytes) -> bool:
        if not value.endswith(self._signature):
            return False
        if self._max_age_ns is None:
            return True
        try:
            sent = int(value[:-len(self._signature)])
        except ValueError:
            return False
        return self._clock() - sent <= self._max_age_ns

    def _heartbeat(self) -> None:
        publish_heartbeat(self._producer, self._topic, 0, str(self._clock()).encode() + self._signature)

    def close(self) -> None:
        """Leave the group (so a standby takes over at once) and flush the last heartbeats."""
        if self._closed:
            return
        self._closed = True
        try:
            self._consumer.close()
        except (KafkaException, RuntimeError) as error:
            log.warning("Closing the leader consumer: %s", error)
        self._producer.flush(1.0)


class Election(Protocol):
    """What the election thread polls: a LeaderElection, or one shard's view of the replica's group
    (shards.ShardElection)."""

    def start(self, on_assigned: Callable[[], None], on_revoked: Callable[[], None],
              on_lost: Callable[[], None]) -> None: ...
    def poll(self, *, heartbeat: bool) -> bool: ...
    def close(self) -> None: ...


#: Hands the core an input, to be taken in at its next turn (Driver.post).
Post = Callable[[Callable[[Any], None]], None]
#: Called inside the revoke callback with what announces the revoke to the core; returns once the core
#: released partition 0 (or the thread stops). The thread blocks on an event; the simulator ends the step
#: there and calls the callback again once released.
Hold = Callable[[Callable[[], None]], None]


class ElectionPoll:
    """The election thread's step: one poll of the election (the rebalance callbacks run in it, a heartbeat
    goes out while the core holds partition 0), and what it saw handed to the core. A revoke is announced
    to the core and held inside Kafka's callback by `hold` until the core answers ReleasePartition, since
    Kafka hands the partition on once the callback returns."""

    def __init__(self, election: Election, post: Post, hold: Hold) -> None:
        self.election = election
        self._post = post
        self._hold = hold
        #: Publish heartbeats (while the core holds partition 0); set by the engine after each turn.
        self.heartbeat = False

    def start(self) -> None:
        """Join the group."""
        post = self._post
        self.election.start(lambda: post(methodcaller("on_assigned")), self._revoked,
                            lambda: post(methodcaller("on_lost")))

    def step(self) -> None:
        seen = self.election.poll(heartbeat=self.heartbeat)
        self._post(lambda core: core.on_polled(seen))

    def _revoked(self) -> None:
        self._hold(lambda: self._post(methodcaller("on_revoked")))

    def close(self) -> None:
        """Leave the group (a revoke callback under way has returned: nothing is in flight)."""
        self.election.close()


def leader_topic_error(error: KafkaError) -> None:
    """An error event of the leader topic's consumer: a fatal one ends the harvester, and so does Kafka refusing the
    group's session timeout, which librdkafka would retry for ever while the replica never leads and says nothing;
    the rest are librdkafka's own retries."""
    if error.fatal():
        raise KafkaUnavailable(f"leader election consumer failed: {error.str()}")
    if error.code() == KafkaError.INVALID_SESSION_TIMEOUT:
        raise KafkaUnavailable(f"Kafka refuses the leader group's session timeout, 3 x heartbeat_timeout "
                               f"({error.str()}): set heartbeat_timeout to at least {MIN_HEARTBEAT_TIMEOUT:g}s, the "
                               f"brokers' group.min.session.timeout.ms (6 s by default) / 3, or lower that minimum")
    log.debug("Leader topic: %s", error.str())


def publish_heartbeat(producer: ProducerLike, topic: str, partition: int, value: bytes) -> None:
    """Produce one heartbeat; a full queue or a transient error is only logged (the next poll sends another),
    a fatal one stops the harvester."""
    try:
        producer.produce(topic, value=value, partition=partition)
    except BufferError:
        log.debug("Heartbeat queue full; Kafka unreachable?")
    except KafkaException as error:
        kafka_error: KafkaError = error.args[0]
        if kafka_error.fatal():
            raise KafkaUnavailable(f"heartbeat producer failed: {kafka_error.str()}") from None
        log.warning("Heartbeat not sent: %s", kafka_error.str())
