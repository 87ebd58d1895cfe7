"""A share queue's topic and its share group's settings, through the admin client.

The share group is configured before its first consumer joins: Kafka's default start offset for a
new share group is the latest, which would skip every message sent before the first consumer;
`share.auto.offset.reset=earliest` keeps them. The lock duration is the queue's redelivery timeout, and
the session timeout and heartbeat follow it within the brokers' ranges (share_session.py), read from a broker.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic, ResourceType

from outbox.kafka.clients import KafkaUnavailable, admin_config
from outbox.queue.config import QueueConfig, QueueLimits
from outbox.queue.share_session import RANGE_CONFIGS, UNBOUNDED, BrokerRanges, failure_detection
from outbox.queue.share_state import group_settings
from outbox.reasons import kafka_reason

log = logging.getLogger(__name__)

_ensured: set[tuple[str, str]] = set()
_ensured_lock = threading.Lock()


class ShareGroupsUnavailable(KafkaUnavailable):
    """The broker has no share groups (before Apache Kafka 4.2, or share.version not enabled)."""


def ensure_share_topic(config: QueueConfig, queue: str, timeout: float, admin: Any = None) -> str:
    """Create the queue's share topic unless it exists (checked once per process); returns its name."""
    topic = config.share_topic(queue)
    marker = (str(config.base_kafka_config.get("bootstrap.servers")), topic)
    if marker in _ensured:
        return topic
    with _ensured_lock:
        if marker in _ensured:
            return topic
        admin = admin or AdminClient(admin_config(config.base_kafka_config))
        try:
            metadata = admin.list_topics(timeout=timeout)
        except KafkaException as error:
            raise KafkaUnavailable(f"Kafka is unreachable at {marker[0]}: {kafka_reason(error)}") from None
        known = metadata.topics.get(topic)
        if known is None or known.error is not None:
            future = admin.create_topics([NewTopic(topic, num_partitions=config.partitions)],
                                         request_timeout=timeout)[topic]
            try:
                future.result()
                log.info("Created topic %s", topic)
            except KafkaException as error:
                if "TOPIC_ALREADY_EXISTS" not in str(error):
                    raise KafkaUnavailable(f"cannot create topic {topic!r} at {marker[0]}: "
                                           f"{kafka_reason(error)}") from None
        _ensured.add(marker)
    return topic


def configure_group(config: QueueConfig, queue: str, limits: QueueLimits, timeout: float, admin: Any = None) -> None:
    """Set the share group's start offset and lock duration (before anyone joins it; harmless after), then its
    session timeout and heartbeat from the lock, so a dead consumer's messages wait about as long as a lock."""
    admin = admin or AdminClient(admin_config(config.base_kafka_config))
    group = config.share_group(queue)
    try:
        _alter(admin, group, group_settings(limits), timeout)
    except KafkaException as error:
        reason = kafka_reason(error)
        if "share" in reason.lower() and ("unknown" in reason.lower() or "unsupported" in reason.lower()):
            raise ShareGroupsUnavailable(f"share group {group!r}: this Kafka has no share groups ({reason}); "
                                         f"the share backend needs Apache Kafka 4.2 or later") from None
        raise KafkaUnavailable(f"cannot configure share group {group!r}: {reason}") from None
    ranges = broker_ranges(admin, timeout)
    detection = failure_detection(limits.redelivery_timeout, ranges or UNBOUNDED)
    try:
        _alter(admin, group, detection.settings, timeout)
    except KafkaException as error:
        log.warning("Share group %s keeps the broker's session timeout (%s): a dead consumer's messages wait that "
                    "long for another; lower group.share.min.session.timeout.ms and "
                    "group.share.min.heartbeat.interval.ms on the brokers (docs/queue-backends.md)", group,
                    kafka_reason(error))
        return
    if detection.exceeds_target:
        log.warning("Share group %s: the brokers' minimum session timeout is %g s, above the lock (%g s): a dead "
                    "consumer's messages wait up to %g s for another; lower group.share.min.session.timeout.ms and "
                    "group.share.min.heartbeat.interval.ms on the brokers (docs/queue-backends.md)", group,
                    detection.session_ms / 1000, limits.redelivery_timeout, detection.bound)


def broker_ranges(admin: Any, timeout: float) -> BrokerRanges | None:
    """The session and heartbeat ranges one broker allows share groups; None if they cannot be read (no
    permission to describe it): then the lock's own values are asked for, and the broker may refuse them."""
    try:
        brokers = admin.list_topics(timeout=timeout).brokers
        resource = ConfigResource(ResourceType.BROKER, str(min(brokers)))
        entries = admin.describe_configs([resource], request_timeout=timeout)[resource].result()
        return BrokerRanges(**{field: int(entries[name].value) for field, name in RANGE_CONFIGS.items()})
    except (KafkaException, KeyError, TypeError, ValueError) as error:
        log.info("Could not read the brokers' share-group session ranges (%s)", kafka_reason(error))
        return None


def _alter(admin: Any, group: str, settings: dict[str, str], timeout: float) -> None:
    entries = [ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)
               for name, value in settings.items()]
    resource = ConfigResource(ResourceType.GROUP, group, incremental_configs=entries)
    admin.incremental_alter_configs([resource], request_timeout=timeout)[resource].result()
