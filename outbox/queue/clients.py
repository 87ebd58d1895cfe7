"""librdkafka settings of every Kafka client the queue uses, in one place.

| client                      | where            | why it is configured so                                        |
|-----------------------------|------------------|----------------------------------------------------------------|
| sender                      | send()           | idempotent; random partitioner spreads a queue over partitions |
| queue consumer              | a consumer       | one group per logical queue; offsets only move in transactions |
| start producer              | a consumer       | transactional: Start markers and the offset commit are atomic  |
| marker producer             | a consumer       | idempotent, keeps KeepAlive/End markers in order               |
| markers consumer            | a tracker        | read_committed, reports the end of a partition                 |
| redelivery producer         | a tracker        | transactional: redelivered message + End marker are atomic     |
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from confluent_kafka import KafkaException

from outbox.kafka.client_errors import log_client_error
from outbox.kafka.clients import LIBRDKAFKA_BATCH_SIZE, client_logger
from outbox.kafka.sizes import UNLIMITED, batch_size_for
from outbox.queue.config import QueueConfig, QueueLimits
from outbox.reasons import kafka_reason

log = logging.getLogger("outbox.queue")
#: A crashed consumer's or tracker's partitions wait this long for a new owner (librdkafka's default
#: is 45 s; Kafka's group.min.session.timeout.ms, 6 s by default, is the floor).
GROUP_TIMEOUTS = {"session.timeout.ms": 10_000, "heartbeat.interval.ms": 2_000}
#: A queue process that has waited for Kafka longer than this (the group's session timeout and 15 s, the time
#: a queue takes to resume after a broker comes back) is stalled: it says so, and outbox_queue_health fails.
STALL_AFTER = GROUP_TIMEOUTS["session.timeout.ms"] / 1000 + 15.0
#: librdkafka's own log lines go through Python logging instead of straight to stderr, as the harvester's do.
client_log = client_logger("outbox.queue.librdkafka")


def _merge(config: QueueConfig, own: dict[str, Any], fixed: dict[str, Any] | None = None,
           batch_limit: int | None = None) -> dict[str, Any]:
    """Our defaults, then the user's base settings, then what correctness depends on; a producer's
    batches fit `batch_limit` bytes (the topics' smaller max.message.bytes)."""
    merged = {**own, **config.base_kafka_config, **(fixed or {})}
    if batch_limit is not None and batch_limit < UNLIMITED:
        try:
            configured = int(merged.get("batch.size", LIBRDKAFKA_BATCH_SIZE))
        except (TypeError, ValueError):
            configured = LIBRDKAFKA_BATCH_SIZE
        merged["batch.size"] = min(configured, batch_size_for(batch_limit))
    merged.setdefault("error_cb", log_client_error)
    merged.setdefault("logger", client_log)
    return merged


def sender_config(config: QueueConfig, name: str, batch_limit: int | None = None) -> dict[str, Any]:
    # The random partitioner spreads one queue's messages over every partition even though they
    # share a key (the queue's name), so all of the queue's consumers get work (as kafka-mq-go).
    return _merge(config, {"partitioner": "random", "linger.ms": 2, "delivery.timeout.ms": 30_000,
                           "client.id": f"{name}-queue-sender"}, {"enable.idempotence": True}, batch_limit)


def queue_consumer_config(config: QueueConfig, queue: str, name: str) -> dict[str, Any]:
    return _merge(config, {"client.id": f"{name}-queue-consumer", "auto.offset.reset": "earliest",
                           "partition.assignment.strategy": "cooperative-sticky", **GROUP_TIMEOUTS},
                  {"group.id": config.consumer_group(queue), "enable.auto.commit": False,
                   "enable.auto.offset.store": False, "isolation.level": "read_committed",
                   "enable.partition.eof": False})


def share_consumer_config(config: QueueConfig, queue: str, name: str, limits: QueueLimits) -> dict[str, Any]:
    """A share queue's consumer: explicit acknowledgements, a batch of at most max_in_progress records."""
    return _merge(config, {"client.id": f"{name}-queue-share-consumer"},
                  {"group.id": config.share_group(queue), "share.acknowledgement.mode": "explicit",
                   "max.poll.records": limits.max_in_progress})


def transactional_id(group: str, name: str) -> str:
    """A consumer's or tracker's transactional id, drawn once per instance and kept by every producer it
    builds: a producer rebuilt after a fatal error then fences its dead predecessor, and its
    init_transactions() aborts the transaction that one left open at once, where a new id would leave it
    to expire after transaction.timeout.ms (and read_committed readers of the markers stalled behind it).
    Since KIP-447 the consumer group's generation, sent with the offsets, fences a zombie; the id needs
    no stable mapping to partitions."""
    return f"{group}-{name}-{uuid.uuid4().hex[:8]}"


def start_producer_config(config: QueueConfig, name: str, txn_id: str, batch_limit: int | None = None
                          ) -> dict[str, Any]:
    return _merge(config, {"client.id": f"{name}-queue-starts", "linger.ms": 0, "transaction.timeout.ms": 60_000},
                  {"transactional.id": txn_id}, batch_limit)


def marker_producer_config(config: QueueConfig, name: str, batch_limit: int | None = None) -> dict[str, Any]:
    return _merge(config, {"client.id": f"{name}-queue-markers", "linger.ms": 2}, {"enable.idempotence": True},
                  batch_limit)


def markers_consumer_config(config: QueueConfig, name: str) -> dict[str, Any]:
    # The end-of-partition event tells the tracker it is caught up, so its deadline clock may run
    # on the local monotonic clock (tracker_state.py).
    return _merge(config, {"client.id": f"{name}-tracker", "auto.offset.reset": "earliest",
                           "partition.assignment.strategy": "cooperative-sticky", **GROUP_TIMEOUTS},
                  {"group.id": config.tracker_group, "enable.auto.commit": False, "enable.auto.offset.store": False,
                   "isolation.level": "read_committed", "enable.partition.eof": True})


def redelivery_producer_config(config: QueueConfig, name: str, txn_id: str, batch_limit: int | None = None
                               ) -> dict[str, Any]:
    # Random partitioner for redelivered messages; End markers name their partition explicitly.
    return _merge(config, {"client.id": f"{name}-redeliveries", "partitioner": "random", "linger.ms": 0},
                  {"transactional.id": txn_id}, batch_limit)


def init_transactions(producer: Any, config: QueueConfig, timeout: float) -> None:
    """init_transactions(), failing in one line that says transactions are what is missing."""
    try:
        producer.init_transactions(timeout)
    except KafkaException as error:
        bootstrap = config.base_kafka_config.get("bootstrap.servers", "?")
        reason = kafka_reason(error)
        raise TransactionsUnavailable(
            f"cannot start Kafka transactions at {bootstrap}: {reason} (a single-broker cluster needs "
            f"transaction.state.log.replication.factor=1 and transaction.state.log.min.isr=1)") from None


class TransactionsUnavailable(Exception):
    """The broker answers but cannot run transactions; the message is one line."""
