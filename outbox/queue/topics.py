"""Creates the queue topic and the markers topic when they are missing, and reads what they accept.

The smaller `max.message.bytes` of the two bounds every queue producer's batches (a message and its
Start marker, which carries its payload, go to one each), as outbox/kafka/sizes.py explains.
"""

from __future__ import annotations

import logging

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from outbox.kafka.clients import KafkaUnavailable, admin_config, admin_describe
from outbox.kafka.sizes import UNLIMITED
from outbox.queue.config import QueueConfig
from outbox.reasons import kafka_reason

log = logging.getLogger(__name__)

#: Marker timestamps are the broker's append time, so deadlines do not depend on the clocks of
#: consumer hosts (kafka-mq-go's point 4); all markers of a queue share one partition leader's clock.
MARKERS_TOPIC_CONFIG = {"message.timestamp.type": "LogAppendTime"}

_ensured: dict[tuple[str, str, str], int] = {}


def ensure_topics(config: QueueConfig, timeout: float) -> int:
    """Create the topic pair unless it exists (once per process); KafkaUnavailable if Kafka cannot be reached.

    Returns the smaller max.message.bytes of the two (topics.UNLIMITED when it cannot be read)."""
    bootstrap = str(config.base_kafka_config.get("bootstrap.servers", "?"))
    marker = (bootstrap, config.topic, config.markers_topic)
    if marker in _ensured:
        return _ensured[marker]
    admin = AdminClient(admin_config(config.base_kafka_config))
    try:
        metadata = admin.list_topics(timeout=timeout)
    except KafkaException as error:
        raise KafkaUnavailable(f"Kafka is unreachable at {bootstrap}: {kafka_reason(error)}") from None
    wanted = [NewTopic(config.topic, num_partitions=config.partitions),
              NewTopic(config.markers_topic, num_partitions=config.markers_partitions, config=MARKERS_TOPIC_CONFIG)]
    missing = [t for t in wanted if t.topic not in metadata.topics or metadata.topics[t.topic].error is not None]
    if missing:
        futures = admin.create_topics(missing, request_timeout=timeout)
        for topic, future in futures.items():
            try:
                future.result(timeout=timeout)
                log.info("Created topic %s", topic)
            except KafkaException as error:
                if error.args and error.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    continue
                raise KafkaUnavailable(f"cannot create topic {topic!r} at {bootstrap}: {kafka_reason(error)}") from None
    limit = _ensured[marker] = topic_limit(config, timeout)
    return limit


def topic_limit(config: QueueConfig, timeout: float) -> int:
    """The smaller max.message.bytes of the queue topic and the markers topic, read from Kafka now."""
    try:
        answers = admin_describe(config.base_kafka_config, timeout)([config.topic, config.markers_topic])
    except Exception as error:  # not readable (no DescribeConfigs permission, Kafka away): the broker judges
        log.debug("Cannot read the queue topics' max.message.bytes: %s", error)
        return UNLIMITED
    return min((value for value in answers.values() if isinstance(value, int)), default=UNLIMITED)
