"""Fast NELI leader election over Kafka, as goneli: whoever owns partition 0 of the leader topic leads.

Kafka's group coordinator assigns partition 0 to one consumer of the group. That alone is not
safe across a network partition: the coordinator may hand the partition to another replica
before this one's rebalance callback runs. So the owner also publishes a heartbeat to the
leader topic every poll and reads it back; when it has seen none of its own for
`heartbeat_timeout` it fences itself (stops sending) well before Kafka's session timeout
(three heartbeat timeouts) could give the partition away, and resumes only on seeing one again
while still assigned.
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from outbox.harvest.config import HarvestConfig
from outbox.harvest.kafka import ConsumerLike, KafkaUnavailable, ProducerLike

log = logging.getLogger(__name__)


class Transition(enum.Enum):
    ACQUIRED = "acquired"  # assigned partition 0, or a fenced leader saw its heartbeat again
    FENCED = "fenced"  # still assigned, but no own heartbeat within the deadline
    REVOKED = "revoked"  # partition 0 revoked in a rebalance (this replica may drain first)
    LOST = "lost"  # the assignment was lost (session expired): another replica may lead already


class Neli:
    """One replica's view of the election. Not thread-safe: the engine thread drives it via pulse()."""

    def __init__(self, config: HarvestConfig, consumer: ConsumerLike, producer: ProducerLike,
                 on_transition: Callable[[Transition], None], clock: Callable[[], float] = time.monotonic) -> None:
        self._topic = config.leader_topic
        self._name = config.name
        self._limits = config.limits
        self._consumer = consumer
        self._producer = producer
        self._on_transition = on_transition
        self._clock = clock
        # Heartbeats carry this replica's name and a random incarnation, so a replica only ever
        # counts its own heartbeats, even if another runs with the same name.
        self._signature = f"%{self._name}%{uuid.uuid4().hex}".encode()
        self._assigned = False
        self._leader = False
        self._last_heartbeat_seen = 0.0
        self._next_poll = 0.0
        self.last_poll = clock()
        self._closed = False

    @property
    def is_leader(self) -> bool:
        return self._leader

    @property
    def is_assigned(self) -> bool:
        return self._assigned

    def start(self) -> None:
        self._consumer.subscribe([self._topic], on_assign=self._on_assign, on_revoke=self._on_revoke,
                                 on_lost=self._on_lost)

    def seconds_to_next_poll(self) -> float:
        return max(0.0, self._next_poll - self._clock())

    def pulse(self) -> None:
        """Poll the leader topic if min_poll_interval has passed since the last poll."""
        if self._clock() >= self._next_poll:
            self.poll()

    def poll(self) -> None:
        now = self._clock()
        self._next_poll = now + self._limits.min_poll_interval
        self.last_poll = now
        received = False
        for message in self._consumer.consume(num_messages=256, timeout=0):
            error = message.error()
            if error is not None:
                if error.fatal():
                    raise KafkaUnavailable(f"leader election consumer failed: {error.str()}")
                log.debug("Leader topic: %s", error.str())
            elif message.partition() == 0 and (message.value() or b"").endswith(self._signature):
                received = True
        now = self._clock()
        if self._assigned:
            if received:
                self._last_heartbeat_seen = now
                if not self._leader:
                    log.info("Resumed leader status (own heartbeat received)")
                    self._leader = True
                    self._on_transition(Transition.ACQUIRED)
            elif self._leader and now - self._last_heartbeat_seen > self._limits.heartbeat_timeout:
                log.warning("Fenced: no own heartbeat for %.1f s", now - self._last_heartbeat_seen)
                self._leader = False
                self._on_transition(Transition.FENCED)
            self._heartbeat()
        self._producer.poll(0)

    def _heartbeat(self) -> None:
        try:
            self._producer.produce(self._topic, value=str(time.time_ns()).encode() + self._signature, partition=0)
        except BufferError:
            log.debug("Heartbeat queue full; Kafka unreachable?")
        except KafkaException as error:
            kafka_error: KafkaError = error.args[0]
            if kafka_error.fatal():
                raise KafkaUnavailable(f"heartbeat producer failed: {kafka_error.str()}") from None
            log.warning("Heartbeat not sent: %s", kafka_error.str())

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        if any(p.partition == 0 for p in partitions) and not self._assigned:
            log.info("Assigned partition 0 of %s: leading", self._topic)
            self._assigned = True
            self._leader = True
            self._last_heartbeat_seen = self._clock()
            self._on_transition(Transition.ACQUIRED)

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        self._lose(partitions, Transition.REVOKED)

    def _on_lost(self, consumer: Any, partitions: list[Any]) -> None:
        self._lose(partitions, Transition.LOST)

    def _lose(self, partitions: list[Any], transition: Transition) -> None:
        if any(p.partition == 0 for p in partitions) and self._assigned:
            log.info("Partition 0 of %s %s", self._topic, "revoked" if transition is Transition.REVOKED else "lost")
            self._assigned = False
            self._leader = False
            self._on_transition(transition)

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
