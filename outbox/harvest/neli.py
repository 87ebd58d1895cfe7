"""Fast NELI leader election over Kafka, as goneli: whoever owns partition 0 of the leader topic leads.

This is the election's I/O only; what it means is decided by the core (core.py). Kafka's group
coordinator assigns partition 0 to one consumer of the group. That alone is not safe across a
network partition: the coordinator may hand the partition to another replica before this one's
rebalance callback runs. So the owner also publishes a heartbeat to the leader topic every poll and
reads it back; the core fences itself when it has seen none of its own for `heartbeat_timeout`,
well before Kafka's session timeout (three heartbeat timeouts) could give the partition away.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from outbox.harvest.kafka import ConsumerLike, ProducerLike
from outbox.kafka.clients import KafkaUnavailable

log = logging.getLogger(__name__)


class LeaderElection:
    """The leader topic's consumer (whose ownership of partition 0 elects) and heartbeat producer."""

    def __init__(self, topic: str, name: str, consumer: ConsumerLike, producer: ProducerLike,
                 max_age: float | None = None) -> None:
        self._topic = topic
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
                if error.fatal():
                    raise KafkaUnavailable(f"leader election consumer failed: {error.str()}")
                log.debug("Leader topic: %s", error.str())
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
        return time.time_ns() - sent <= self._max_age_ns

    def _heartbeat(self) -> None:
        publish_heartbeat(self._producer, self._topic, 0, str(time.time_ns()).encode() + self._signature)

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
