"""What every Kafka client of the outbox shares (the harvester's, the queues', the maintenance commands'): where
librdkafka's own log lines go, the admin client's settings, the one-line failure to reach Kafka, and the
topics' max.message.bytes as the brokers tell them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

#: librdkafka's own log lines go through Python logging instead of straight to stderr.
client_log = logging.getLogger("outbox.harvest.librdkafka")


class _KnownWarnings(logging.Filter):
    """librdkafka warns at every start that enable.gapless.guarantee is experimental: it is on purpose. And on a
    cluster's first use of transactions or idempotence, that the coordinator is still loading its log and it retries
    getting a producer id: that passes by itself in a moment, so it is said at INFO."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "CONFWARN" in message and "enable.gapless.guarantee" in message:
            return False
        if record.levelno == logging.WARNING and "GETPID" in message and "load in progress" in message:
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            return client_log.isEnabledFor(logging.INFO)  # the logger let it through as a warning
        return True


client_log.addFilter(_KnownWarnings())


def silent_logger(name: str) -> logging.Logger:
    """A logger for librdkafka lines nobody should hear: it drops every record itself. A filter, not propagate=False
    and a NullHandler, which a LOGGING dictConfig naming `outbox` after this import resets (it sets every existing
    child of a logger it configures to propagate, with no handlers), and then `manage.py check` would log the
    throwaway clients' "Connect to 127.0.0.1:1 failed" at ERROR."""
    logger = logging.getLogger(name)
    logger.addFilter(lambda _record: False)
    return logger


#: The clients built only to have librdkafka check the settings say nothing.
check_log = silent_logger("outbox.harvest.librdkafka.check")


class KafkaUnavailable(Exception):
    """Kafka cannot be reached or used; the message is one line for the operator."""


#: librdkafka's default batch.size.
LIBRDKAFKA_BATCH_SIZE = 1_000_000
#: How long a client's start (metadata, topic creation, init_transactions) waits for Kafka before it is
#: reported unreachable: the harvester's, the queue consumer's and the tracker's.
KAFKA_START_TIMEOUT = 10.0

Describe = Callable[[list[str]], Mapping[str, "int | BaseException"]]


def admin_config(base: Mapping[str, Any]) -> dict[str, Any]:
    return {**{k: v for k, v in base.items() if not callable(v)}, "logger": client_log}


def admin_describe(base: Mapping[str, Any], timeout: float = 5.0) -> Describe:
    """A Describe over an AdminClient with the clients' shared settings."""
    admin = AdminClient(admin_config(base))

    def describe(topics: list[str]) -> dict[str, int | BaseException]:
        futures = admin.describe_configs([ConfigResource(ResourceType.TOPIC, topic) for topic in topics],
                                         request_timeout=timeout)
        answers: dict[str, int | BaseException] = {}
        for resource, future in futures.items():
            try:
                entry = future.result(timeout=timeout)["max.message.bytes"]
                answers[resource.name] = int(entry.value)
            except Exception as error:
                answers[resource.name] = error
        return answers

    return describe
