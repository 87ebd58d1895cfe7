"""Riding through an outage: the one line when a wait begins and ends, a call librdkafka never returns from,
a transactional producer replaced with its transactional id kept, and librdkafka's repeated errors."""

from __future__ import annotations

import logging
import threading

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from outbox.kafka import client_errors
from outbox.kafka.outage import Outage, fatal, permanent
from outbox.queue import transactional
from outbox.queue.transactional import TransactionalWriter, call_with_deadline


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_wait_is_said_once_when_it_begins_and_once_when_it_ends(caplog):
    clock = Clock()
    outage = Outage(logging.getLogger("outbox.test"), "Consumer of queue q", clock)
    with caplog.at_level(logging.INFO, logger="outbox.test"):
        assert outage.waited() == 0.0
        outage.waiting("Kafka to commit transactions", KafkaException(KafkaError(KafkaError._TRANSPORT, "gone")))
        clock.now += 5
        outage.waiting("something else", "still gone")
        assert outage.waited() == 5.0 and outage.what == "Kafka to commit transactions"
        assert outage.reason == "still gone", "the last attempt's reason is kept for the status"
        clock.now += 2.5
        outage.resumed()
        outage.resumed()
    assert [r.getMessage() for r in caplog.records] == [
        "Consumer of queue q: waiting for Kafka to commit transactions (gone)",
        "Consumer of queue q: resumed after 7.5 s waiting for Kafka to commit transactions"]
    assert outage.waited() == 0.0 and outage.since is None


def test_a_probe_asks_at_most_once_a_second_and_an_answer_ends_the_wait():
    clock = Clock()
    outage = Outage(logging.getLogger("outbox.test"), "Tracker t", clock)
    asked = []

    def unanswered(timeout: float) -> None:
        asked.append(clock.now)
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "no answer"))

    outage.probe(unanswered)
    assert asked == [], "nothing is asked while nothing is waited for"
    outage.waiting("Kafka's brokers", "1/1 brokers are down")
    outage.probe(unanswered)
    outage.probe(unanswered)
    clock.now += 1.0
    outage.probe(unanswered)
    assert asked == [100.0, 101.0] and outage.since is not None
    clock.now += 1.0
    outage.probe(lambda timeout: None)
    assert outage.since is None


def test_only_all_brokers_down_is_a_wait_among_librdkafkas_errors(caplog):
    outage = Outage(logging.getLogger("outbox.test"), "Consumer of queue q", Clock())
    outage.client_error(KafkaError(KafkaError._TRANSPORT, "b:9092/1: Disconnected"))
    assert outage.since is None
    outage.client_error(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))
    assert outage.what == "Kafka's brokers"
    config = outage.watch({"bootstrap.servers": "b:9092", "error_cb": client_errors.log_client_error})
    assert config["error_cb"] == outage.client_error
    own = outage.watch({"error_cb": print})
    assert own["error_cb"] is print, "an application's own callback is left alone"


def test_what_ends_a_process_and_what_replaces_a_client():
    authentication = KafkaException(KafkaError(KafkaError.SASL_AUTHENTICATION_FAILED, "bad password"))
    fenced = KafkaException(KafkaError(KafkaError.PRODUCER_FENCED, "fenced", fatal=True))
    transport = KafkaException(KafkaError(KafkaError._TRANSPORT, "gone"))
    assert permanent(authentication) and not permanent(fenced) and not permanent(transport)
    assert fatal(fenced) and not fatal(transport) and not fatal(RuntimeError("x"))


def test_the_same_client_error_is_logged_once_a_minute(caplog, monkeypatch):
    monkeypatch.setattr(client_errors, "_last_logged", {})
    now = [1000.0]
    monkeypatch.setattr(client_errors, "_clock", lambda: now[0])
    refused = ("127.0.0.1:9190/bootstrap: Connect to ipv4#127.0.0.1:9190 failed: Connection refused "
               "(after {}ms in state CONNECT)")
    with caplog.at_level(logging.DEBUG, logger="outbox.harvest.kafka"):
        for elapsed in (0, 1, 2, 30):
            now[0] = 1000.0 + elapsed
            client_errors.log_client_error(KafkaError(KafkaError._TRANSPORT, refused.format(elapsed)))
        now[0] = 1061.0
        client_errors.log_client_error(KafkaError(KafkaError._TRANSPORT, refused.format(3)))
        client_errors.log_client_error(KafkaError(KafkaError._FATAL, "fatal", fatal=True))
        client_errors.log_client_error(KafkaError(KafkaError._FATAL, "fatal", fatal=True))
    levels = [record.levelno for record in caplog.records]
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG, logging.DEBUG, logging.WARNING,
                      logging.ERROR, logging.ERROR], "fatal errors are never held back"


def test_a_call_that_never_returns_counts_as_fatal(monkeypatch):
    monkeypatch.setattr(transactional, "STUCK_GRACE", 0.05)
    release = threading.Event()

    def stuck(*args: object) -> None:
        release.wait(30)  # librdkafka's send_offsets_to_transaction() with its coordinator gone

    try:
        with pytest.raises(KafkaException) as raised:
            call_with_deadline(stuck, 0.01)
        assert raised.value.args[0].fatal() and "did not return" in raised.value.args[0].str()
    finally:
        release.set()
    assert call_with_deadline(lambda timeout: timeout * 2, 0.5) == 1.0
    with pytest.raises(ValueError, match="raised in the call"):
        call_with_deadline(lambda timeout: (_ for _ in ()).throw(ValueError("raised in the call")), 0.5)


class Producer:
    """A transactional producer whose calls fail as told."""

    built: list[Producer] = []

    def __init__(self, failures: dict[str, list[KafkaError]]) -> None:
        self.failures, self.calls = failures, []
        Producer.built.append(self)

    def _call(self, name: str) -> None:
        self.calls.append(name)
        queued = self.failures.get(name)
        if queued:
            raise KafkaException(queued.pop(0))

    def init_transactions(self, timeout: float) -> None:
        self._call("init")

    def begin_transaction(self) -> None:
        self._call("begin")

    def send_offsets_to_transaction(self, offsets: object, metadata: object, timeout: float) -> None:
        self._call("offsets")

    def commit_transaction(self, timeout: float) -> None:
        self._call("commit")

    def abort_transaction(self, timeout: float) -> None:
        self._call("abort")


def test_a_fatal_error_replaces_the_producer_and_a_wait_keeps_it_until_transactions_start():
    Producer.built = []
    failures = {"abort": [KafkaError(KafkaError.INVALID_TXN_STATE, "invalid state", fatal=True)],
                "offsets": [KafkaError(KafkaError._TRANSPORT, "gone", txn_requires_abort=True)]}
    outage = Outage(logging.getLogger("outbox.test"), "Consumer of queue q", Clock())
    writer = TransactionalWriter(lambda: Producer(failures), outage, caller=transactional.call_at_once)
    writer.open()
    error = writer.run(lambda producer: ["offset"], lambda: "metadata")
    assert error is not None and writer.lost and writer.replaced == 1, "the abort failed fatally: producer lost"
    assert outage.since is not None
    failures["init"] = [KafkaError(KafkaError._TIMED_OUT, "coordinator away", retriable=True)]
    assert not writer.ready(), "Kafka cannot start transactions yet: waited for"
    assert writer.ready() and len(Producer.built) == 2, "the same new producer, its transactions started"
    assert writer.run(lambda producer: ["offset"], lambda: "metadata") is None
    assert outage.since is None
    assert Producer.built[1].calls == ["init", "init", "begin", "offsets", "commit"]


def test_an_error_no_wait_fixes_is_raised():
    failures = {"commit": [KafkaError(KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, "not allowed")]}
    writer = TransactionalWriter(lambda: Producer(failures), Outage(logging.getLogger("outbox.test"), "q", Clock()),
                                 caller=transactional.call_at_once)
    writer.open()
    with pytest.raises(KafkaException, match="not allowed"):
        writer.run(lambda producer: None, lambda: "metadata")


class CoordinatorLost:
    """A markers consumer whose coordinator went away in a broker's restart and is never asked for again: its
    synchronous commit and its close (which commits in the revoke) never return; an asynchronous commit is only
    queued."""

    def __init__(self, release: threading.Event) -> None:
        self.release, self.queued = release, 0

    def commit(self, offsets: object = None, asynchronous: bool = True) -> None:
        if asynchronous:
            self.queued += 1
            return
        self.release.wait(30)

    def close(self) -> None:
        self.release.wait(30)


def test_a_tracker_stops_though_its_coordinator_never_answers(monkeypatch):
    from outbox.queue import tracker as tracker_module
    from outbox.queue.config import QueueConfig
    from outbox.queue.tracker import RedeliveryTracker

    monkeypatch.setattr(transactional, "STUCK_GRACE", 0.05)
    monkeypatch.setattr(tracker_module, "COMMIT_TIMEOUT", 0.05, raising=False)
    monkeypatch.setattr(tracker_module, "CLOSE_TIMEOUT", 0.05, raising=False)
    release = threading.Event()
    tracker = RedeliveryTracker(QueueConfig(base_kafka_config={"bootstrap.servers": "fake:9092"}),
                                dead_letters=lambda letters: None, name="t")
    tracker._consumer = lost = CoordinatorLost(release)
    monkeypatch.setattr(tracker, "_offsets", lambda: [TopicPartition("markers", 0, 42)])
    try:
        tracker._commit()  # now and then: sent, not waited for
        assert lost.queued == 1
        tracker._commit(force=True)  # leaving: waited for, within COMMIT_TIMEOUT
        tracker.close()  # within CLOSE_TIMEOUT
        assert tracker.wait(timeout=0) is True
    finally:
        release.set()


class RejoiningConsumer:
    """A markers consumer whose group lost its partitions in an outage and has not got them back: polls find
    nothing; the broker answers a question again once `back` is set."""

    def __init__(self) -> None:
        self.back = False
        self.asked: list[tuple[str, int]] = []

    def poll(self, timeout: float) -> None:
        return None

    def get_watermark_offsets(self, partition: TopicPartition, timeout: float | None = None,
                              cached: bool = False) -> tuple[int, int]:
        self.asked.append((partition.topic, partition.partition))
        if not self.back:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "Connection refused"))
        return 0, 0


def test_a_tracker_with_no_partitions_left_still_sees_the_brokers_return(caplog):
    """A session timeout in the outage revokes every partition; the rejoin may take longer than the brokers' return,
    and the tracker still says the wait ended (its probe asks a partition it does not track)."""
    from outbox.queue.config import QueueConfig
    from outbox.queue.tracker import RedeliveryTracker

    clock = Clock()
    tracker = RedeliveryTracker(QueueConfig(base_kafka_config={"bootstrap.servers": "fake:9092"}),
                                dead_letters=lambda letters: None, name="t", clock=clock)
    tracker._consumer = consumer = RejoiningConsumer()
    tracker._kafka.client_error(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))
    with caplog.at_level(logging.INFO, logger="outbox.queue.tracker"):
        tracker.step()
        assert tracker.waiting_for() is not None
        assert consumer.asked == [(tracker.config.markers_topic, 0)]
        consumer.back = True
        clock.now += 0.5
        tracker.step()  # at most one question a second
        assert len(consumer.asked) == 1
        clock.now += 1.0
        tracker.step()
    assert tracker.waiting_for() is None
    assert len(consumer.asked) == 2
    assert [r.getMessage() for r in caplog.records if "resumed after" in r.getMessage()] == [
        "Tracker t: resumed after 1.5 s waiting for Kafka's brokers"]
