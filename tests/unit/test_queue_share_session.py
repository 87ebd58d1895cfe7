"""A share group's session timeout and heartbeat from the queue's lock and the brokers' ranges (share_session.py),
and what configure_group() asks the broker for and says (share_group.py, against a fake admin client)."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from outbox.queue.config import QueueConfig, QueueLimits
from outbox.queue.share_group import configure_group
from outbox.queue.share_session import RANGE_CONFIGS, UNBOUNDED, BrokerRanges, FailureDetection, failure_detection

#: bin/services's brokers (and the compose files'): sessions from 1 s, heartbeats from 250 ms.
SERVICES = BrokerRanges(min_session_ms=1_000, max_session_ms=60_000, min_heartbeat_ms=250, max_heartbeat_ms=15_000)


@pytest.mark.parametrize(("lock", "session", "heartbeat"), [
    (1.0, 1_000, 250),
    (2.0, 2_000, 500),
    (3.0, 3_000, 750),
    (10.0, 10_000, 1_000),  # heartbeats at most 1 s: a survivor hears of new partitions within 1 s
    (30.0, 10_000, 1_000),  # at most 10 s: a dead consumer's untaken records need not wait for a long lock
    (3600.0, 10_000, 1_000),
])
def test_the_session_follows_the_lock_up_to_10_s_with_heartbeats_a_quarter_of_it(lock, session, heartbeat):
    assert failure_detection(lock, SERVICES) == FailureDetection(session_ms=session, heartbeat_ms=heartbeat,
                                                                 lock_ms=round(lock * 1000))


@pytest.mark.parametrize("lock", [1.0, 1.5, 2.0, 3.0, 7.25, 30.0, 59.9, 600.0, 3600.0])
def test_where_the_brokers_allow_it_a_dead_consumers_messages_wait_at_most_the_lock_plus_2_s(lock):
    detection = failure_detection(lock, SERVICES)
    assert detection.bound <= lock + 2 and not detection.exceeds_target
    assert detection.heartbeat_ms < detection.session_ms, "the broker refuses a heartbeat as long as the session"


def test_kafkas_default_minimums_clamp_the_session_and_say_the_target_is_missed():
    detection = failure_detection(2.0, BrokerRanges())
    assert (detection.session_ms, detection.heartbeat_ms) == (45_000, 5_000)
    assert detection.exceeds_target and detection.bound == 50.5


def test_a_minimum_heartbeat_above_a_short_session_lengthens_the_session():
    detection = failure_detection(2.0, BrokerRanges(min_session_ms=1_000, min_heartbeat_ms=3_000))
    assert detection.heartbeat_ms == 3_000 and detection.session_ms == 12_000


def test_unknown_ranges_ask_for_the_locks_own_values():
    assert failure_detection(2.0, UNBOUNDED).settings == {"share.session.timeout.ms": "2000",
                                                           "share.heartbeat.interval.ms": "500"}


class FakeAdmin:
    """incremental_alter_configs and describe_configs of confluent-kafka's AdminClient, remembered."""

    def __init__(self, ranges: dict[str, str] | None, refuse_session: bool = False) -> None:
        self.ranges, self.refuse_session = ranges, refuse_session
        self.altered: list[dict[str, str]] = []

    @staticmethod
    def _done(value: Any = None, error: BaseException | None = None) -> Future:
        future: Future = Future()
        future.set_exception(error) if error is not None else future.set_result(value)
        return future

    def incremental_alter_configs(self, resources: list[Any], request_timeout: float) -> dict[Any, Future]:
        [resource] = resources
        settings = {entry.name: entry.value for entry in resource.incremental_configs}
        self.altered.append(settings)
        refused = self.refuse_session and "share.session.timeout.ms" in settings
        error = KafkaException(KafkaError(KafkaError.INVALID_CONFIG, "share.session.timeout.ms must be greater "
                                          "than or equal to group.share.min.session.timeout.ms")) if refused else None
        return {resource: self._done(error=error)}

    def list_topics(self, timeout: float) -> Any:
        return SimpleNamespace(brokers={2: None, 1: None})

    def describe_configs(self, resources: list[Any], request_timeout: float) -> dict[Any, Future]:
        [resource] = resources
        assert resource.name == "1"
        if self.ranges is None:
            return {resource: self._done(error=KafkaException(KafkaError(KafkaError.CLUSTER_AUTHORIZATION_FAILED)))}
        return {resource: self._done({name: SimpleNamespace(value=value) for name, value in self.ranges.items()})}


def ranges_of(ranges: BrokerRanges) -> dict[str, str]:
    return {name: str(getattr(ranges, field)) for field, name in RANGE_CONFIGS.items()}


CONFIG = QueueConfig(base_kafka_config={"bootstrap.servers": "fake:9092"})
LIMITS = QueueLimits(redelivery_timeout=2.0, backend="share")


def test_configure_group_sets_the_lock_then_the_session_that_follows_it(caplog):
    admin = FakeAdmin(ranges_of(SERVICES))
    with caplog.at_level(logging.WARNING):
        configure_group(CONFIG, "emails", LIMITS, 5.0, admin=admin)
    assert admin.altered == [
        {"share.auto.offset.reset": "earliest", "share.record.lock.duration.ms": "2000"},
        {"share.session.timeout.ms": "2000", "share.heartbeat.interval.ms": "500"},
    ]
    assert not caplog.records


def test_configure_group_clamps_to_the_brokers_minimum_and_says_how_long_messages_wait(caplog):
    admin = FakeAdmin(ranges_of(BrokerRanges(min_session_ms=6_000, min_heartbeat_ms=1_000)))
    with caplog.at_level(logging.WARNING):
        configure_group(CONFIG, "emails", LIMITS, 5.0, admin=admin)
    assert admin.altered[-1] == {"share.session.timeout.ms": "6000", "share.heartbeat.interval.ms": "1000"}
    [warning] = caplog.records
    assert "minimum session timeout is 6 s, above the lock (2 s)" in warning.message
    assert "wait up to 7.5 s" in warning.message and "\n" not in warning.message


def test_configure_group_without_the_ranges_asks_for_the_locks_values_and_warns_once_if_refused(caplog):
    admin = FakeAdmin(None, refuse_session=True)
    with caplog.at_level(logging.WARNING):
        configure_group(CONFIG, "emails", LIMITS, 5.0, admin=admin)
    assert admin.altered[-1] == {"share.session.timeout.ms": "2000", "share.heartbeat.interval.ms": "500"}
    [warning] = caplog.records
    assert "keeps the broker's session timeout" in warning.message and "\n" not in warning.message
