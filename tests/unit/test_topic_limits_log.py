"""What TopicLimits logs as a topic's max.message.bytes becomes known: a warning only when a limit it
had read changes, not when a topic the first record creates is read for the first time."""

from __future__ import annotations

import logging

from confluent_kafka import KafkaError, KafkaException

from outbox.harvest.topics import TopicLimits


class Brokers:
    """describe() answering from a dict: a topic missing from it does not exist yet."""

    def __init__(self) -> None:
        self.limits: dict[str, int] = {}

    def describe(self, topics):
        return {t: self.limits.get(t, KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))) for t in topics}


def test_a_topic_read_for_the_first_time_after_it_is_created_is_no_warning(caplog):
    brokers, now = Brokers(), [0.0]
    limits = TopicLimits(brokers.describe, refresh_interval=60, clock=lambda: now[0])
    caplog.set_level(logging.DEBUG, logger="outbox.harvest")
    assert limits.limit("orders") is None
    limits.learn()  # not created yet: its first record will create it
    brokers.limits["orders"] = 1_048_588
    now[0] = 3600
    limits.learn()
    assert limits.limit("orders") == 1_048_588
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "Topic orders: max.message.bytes is 1,048,588 bytes" in caplog.text

    brokers.limits["orders"] = 4096  # an operator lowers it
    now[0] = 7200
    limits.learn()
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage() == "Topic orders: max.message.bytes changed from 1,048,588 to 4,096 bytes"
