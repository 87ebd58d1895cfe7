"""What every Kafka client of the outbox shares (the harvester's, the queues', the maintenance commands'): where
librdkafka's own log lines go, the admin client's settings, the one-line failure to reach Kafka, and the
topics' max.message.bytes as the brokers tell them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from outbox.kafka.client_errors import said_lately


class _KnownLines(logging.Filter):
    """What librdkafka logs that needs no operator, or not again. It warns at every start that
    enable.gapless.guarantee is experimental: it is on purpose. On a cluster's first use of transactions or
    idempotence, that the coordinator is still loading its log and it retries getting a producer id: that passes
    by itself in a moment, so it is said at INFO. And while a broker is away, every client logs each failed
    connection at ERROR about once a second (`FAIL`): a failure librdkafka retries by itself, said at WARNING once a
    minute with the error callback's own report of it (client_errors.said_lately), its repeats at DEBUG."""

    #: What client_logger() looks for: a reload of this module makes a new class, which isinstance() would miss.
    known_lines = True

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "CONFWARN" in message and "enable.gapless.guarantee" in message:
            return False
        if record.levelno == logging.WARNING and "GETPID" in message and "load in progress" in message:
            return _said_at(record, logging.INFO)
        # confluent-kafka logs (facility, client name, "[thrd:...]: text")
        fac, text = (record.args[0], str(record.args[2])) if isinstance(record.args, tuple) and \
            len(record.args) == 3 else (None, message)
        if fac == "FAIL" and record.levelno >= logging.WARNING:
            return _said_at(record, logging.DEBUG if said_lately(text.split("]: ", 1)[-1]) else logging.WARNING)
        return True


def _said_at(record: logging.LogRecord, level: int) -> bool:
    """The record at `level`, if its logger hears that level (the logger let it through at its own)."""
    record.levelno, record.levelname = level, logging.getLevelName(level)
    return logging.getLogger(record.name).isEnabledFor(level)


def client_logger(name: str) -> logging.Logger:
    """The logger a client hands librdkafka's own lines to (Python logging instead of straight to stderr). Its filter
    is added once, however often this is called for one name (a module reloaded): a second _KnownLines would take
    the first's "said now" for "said lately" and turn the one WARNING of a failed connection into DEBUG."""
    logger = logging.getLogger(name)
    if not any(getattr(known, "known_lines", False) for known in logger.filters):
        logger.addFilter(_KnownLines())
    return logger


#: The harvester's and the maintenance commands' clients' (the queues' have their own: queue/clients.py).
client_log = client_logger("outbox.harvest.librdkafka")


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
