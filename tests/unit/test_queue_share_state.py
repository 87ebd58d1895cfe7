"""The share backend's decisions (share_state.py) and its poller (share_consumer.py) against a fake client."""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import pytest
from confluent_kafka import AcknowledgeType, IllegalStateException, KafkaError, KafkaException

from outbox.queue.config import QueueConfig, QueueLimits
from outbox.queue.consumer_state import Delivery
from outbox.queue.share_consumer import ShareQueueConsumer
from outbox.queue.share_state import (
    LETTER_RETRY,
    LOCK_MARGIN,
    Ack,
    Outcome,
    ShareState,
    Verdict,
    group_settings,
    verdict,
)

LIMITS = QueueLimits(redelivery_timeout=10.0, max_deliveries=3, backend="share", max_in_progress=4)


def delivery(offset: int, deliveries: int = 1, at: float = 0.0) -> Delivery:
    return Delivery(ref=(0, offset), id=f"m{offset}", key=None, payload=b"x", raw_headers=[("mq-id", b"m")],
                    deliveries=deliveries, received_at=at, last_marker=at)


@pytest.mark.parametrize(("outcome", "deliveries", "delay", "expected"), [
    (Outcome.ACKED, 3, 0, Verdict(Ack.ACCEPT)),
    (Outcome.ABANDONED, 1, 0, Verdict(Ack.RELEASE)),
    (Outcome.ABANDONED, 3, 0, Verdict(Ack.REJECT, dead_letter=True)),
    (Outcome.RETRIED, 2, 0, Verdict(Ack.RELEASE)),
    (Outcome.RETRIED, 1, 2.0, Verdict(Ack.RELEASE, at=102.0)),
    (Outcome.RETRIED, 1, 60.0, Verdict(Ack.RELEASE, at=100.0 + 10.0 - LOCK_MARGIN)),  # never past the lock
    (Outcome.RETRIED, 3, 2.0, Verdict(Ack.REJECT, dead_letter=True)),
    (Outcome.RELEASED, 3, 0, Verdict(Ack.RELEASE)),  # never handed out: not the handler's failure
])
def test_verdicts(outcome, deliveries, delay, expected):
    assert verdict(outcome, deliveries, LIMITS, now=100.0, locked_at=100.0, delay=delay) == expected


def test_no_max_deliveries_never_dead_letters():
    limits = QueueLimits(max_deliveries=None)
    assert verdict(Outcome.ABANDONED, 50, limits, now=0, locked_at=0) == Verdict(Ack.RELEASE)


def test_the_group_starts_at_the_earliest_offset_with_the_lock_from_the_redelivery_timeout():
    assert group_settings(LIMITS) == {"share.auto.offset.reset": "earliest", "share.record.lock.duration.ms": "10000"}


def test_a_record_past_max_deliveries_is_dead_on_arrival_and_the_rest_buffered():
    state = ShareState("q", LIMITS)
    dead = state.arrived([delivery(1), delivery(2, deliveries=4)])
    assert [d.ref for d in dead] == [(0, 2)] and state.redelivered == 1
    due = state.take_due(0.0)
    assert [(s.delivery.ref, s.verdict) for s in due] == [((0, 2), Verdict(Ack.REJECT, dead_letter=True))]
    assert state.take(0.0).ref == (0, 1) and state.take(0.0) is None


def test_the_batch_is_done_only_when_every_record_was_sent_and_a_second_ack_does_nothing():
    state = ShareState("q", LIMITS)
    state.arrived([delivery(1), delivery(2)])
    first, second = state.take(1.0), state.take(1.0)
    assert state.settle(first, Outcome.ACKED, 2.0) == Verdict(Ack.ACCEPT)
    assert state.settle(first, Outcome.ABANDONED, 2.0) is None
    for settling in state.take_due(2.0):
        state.sent(settling)
    assert not state.batch_done
    state.settle(second, Outcome.RETRIED, 2.0, delay=1.0)
    assert state.take_due(2.5) == [] and state.next_due() == 3.0
    [late] = state.take_due(3.0)
    state.sent(late)
    assert state.batch_done and (state.acked, state.retried) == (1, 1)


def test_a_retry_is_released_before_the_lock_that_began_at_the_fetch_ends():
    """The lock starts when Kafka hands the record out, not when receive() does: a record handed out 5 s into a
    10 s lock and retried for a minute was held until 14.5 s, past its lock (found by the share simulator)."""
    state = ShareState("q", LIMITS)
    state.arrived([delivery(1, at=0.0)])
    decided = state.settle(state.take(5.0), Outcome.RETRIED, 5.0, delay=60.0)
    assert decided == Verdict(Ack.RELEASE, at=10.0 - LOCK_MARGIN) and state.next_due() == 10.0 - LOCK_MARGIN


def test_an_acknowledgement_is_due_at_once_on_a_monotonic_clock_below_zero():
    """A monotonic clock's reference point is undefined (the simulator's processes start theirs anywhere): an
    ACCEPT at -3304.5 was held back as if delayed until the clock passed 0 (found by tests/sim/share_scenario.py)."""
    state = ShareState("q", LIMITS)
    state.arrived([delivery(1, at=-3310.0)])
    state.settle(state.take(-3305.0), Outcome.ACKED, -3304.5)
    assert [s.verdict.ack for s in state.take_due(-3304.5)] == [Ack.ACCEPT]


def test_buffered_records_whose_lock_ends_go_back_unhandled():
    state = ShareState("q", LIMITS)
    state.arrived([delivery(1, at=0.0), delivery(2, at=0.0)])
    assert state.next_due() == 10.0 - LOCK_MARGIN
    assert state.take(10.0 - LOCK_MARGIN) is None, "never handed out when its lock is about to end"
    assert {s.verdict.ack for s in state.take_due(10.0)} == {Ack.RELEASE} and state.released == 2


class FakeShareConsumer:
    """Records what the poller does with the client; hands out the batches it is given."""

    def __init__(self, batches: list[list[Any]]) -> None:
        self.batches, self.acks, self.commits, self.closed = batches, [], 0, False
        self.gone: set[int] = set()

    def subscribe(self, topics: list[str]) -> None:
        self.topics = topics

    def set_acknowledgement_commit_callback(self, callback: Any) -> None:
        self.callback = callback

    def poll(self, timeout: float) -> list[Any]:
        return self.batches.pop(0) if self.batches else []

    def acknowledge_offset(self, topic: str, partition: int, offset: int, ack_type: Any) -> None:
        if offset in self.gone:
            raise IllegalStateException("offset not in flight")
        self.acks.append((offset, ack_type))

    def commit_async(self) -> None:
        self.commits += 1

    def close(self) -> None:
        self.closed = True


class FakeRecord:
    def __init__(self, offset: int, deliveries: int) -> None:
        self._offset, self._deliveries = offset, deliveries

    def error(self) -> None:
        return None

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def delivery_count(self) -> int:
        return self._deliveries

    def key(self) -> bytes:
        return b"q/id"

    def value(self) -> bytes:
        return b"{}"

    def headers(self) -> list[tuple[str, bytes]]:
        return [("mq-id", f"id{self._offset}".encode()), ("app", b"1")]


def poller(fake: FakeShareConsumer, sink: Any) -> ShareQueueConsumer:
    consumer = ShareQueueConsumer(QueueConfig(limits=LIMITS), "q", dead_letters=sink, consumer_factory=lambda c: fake)
    consumer._consumer = fake  # as open() leaves it, without Kafka
    return consumer


def test_a_dead_letter_is_written_before_the_reject():
    letters: list[Any] = []
    fake = FakeShareConsumer([[FakeRecord(7, 4)]])
    consumer = poller(fake, letters.extend)
    consumer.round()  # polls: record 7 is dead on arrival
    consumer.round()  # writes its letter, then REJECTs it
    assert [(letter.message_id, letter.deliveries, letter.headers) for letter in letters] == [
        ("id7", 4, [("app", b"1")])]
    assert fake.acks == [(7, AcknowledgeType.REJECT)] and consumer.dead_lettered == 1


def test_a_dead_letter_that_cannot_be_written_is_tried_again_while_the_lock_holds_then_released():
    """A RELEASE spends a delivery, and past the broker's delivery limit Kafka archives the record unseen: a
    failed write is retried within the lock first (the share simulator lost messages this way, seeds 134, 212)."""
    now = [100.0]
    letters: list[Any] = []
    failures = [2]

    def flaky(batch: Any) -> None:
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError("database down")
        letters.extend(batch)

    fake = FakeShareConsumer([[FakeRecord(7, 4)], [FakeRecord(8, 4)]])
    consumer = ShareQueueConsumer(QueueConfig(limits=LIMITS), "q", dead_letters=flaky, consumer_factory=lambda c: fake,
                                  clock=lambda: now[0])
    consumer._consumer = fake
    consumer.round()  # polls record 7: dead on arrival
    consumer.round()  # its letter fails: nothing acknowledged, tried again later
    assert fake.acks == [] and consumer.in_progress == 1
    now[0] += LETTER_RETRY
    consumer.round()  # fails again
    now[0] += LETTER_RETRY
    consumer.round()  # written: REJECT
    assert fake.acks == [(7, AcknowledgeType.REJECT)] and [letter.message_id for letter in letters] == ["id7"]
    failures[0] = 1_000
    consumer.round()  # polls record 8 at t=101
    consumer.round()
    now[0] += 10.0 - LOCK_MARGIN - LETTER_RETRY - 1.0  # the letter keeps failing until the lock is about to end
    consumer.round()
    assert fake.acks[-1] == (7, AcknowledgeType.REJECT)
    now[0] += 1.0
    consumer.round()
    assert fake.acks[-1] == (8, AcknowledgeType.RELEASE), "no letter written: it comes back rather than archived"
    assert consumer.dead_lettered == 1


def test_the_poller_waits_for_the_whole_batch_before_polling_again():
    fake = FakeShareConsumer([[FakeRecord(1, 1), FakeRecord(2, 1)], [FakeRecord(3, 1)]])
    consumer = poller(fake, lambda letters: None)
    consumer.round()
    first = consumer.receive(timeout=0)
    first.ack()
    consumer.round()
    assert fake.acks == [(1, AcknowledgeType.ACCEPT)] and len(fake.batches) == 1, "record 2 unsettled: no poll"
    consumer.receive(timeout=0).abandon()
    consumer.round()
    consumer.round()
    assert fake.acks[-1] == (2, AcknowledgeType.RELEASE) and fake.batches == []


def test_an_acknowledgement_the_client_no_longer_takes_is_logged_and_the_batch_moves_on(caplog):
    caplog.set_level(logging.WARNING, logger="outbox")  # the simulators' tests quiet it, in whatever order tests run
    fake = FakeShareConsumer([[FakeRecord(1, 1)], [FakeRecord(2, 1)]])
    fake.gone.add(1)
    consumer = poller(fake, lambda letters: None)
    consumer.round()
    consumer.receive(timeout=0).ack()
    consumer.round()
    assert "Could not acknowledge q/id1" in caplog.text and consumer.failure is None
    consumer.round()
    assert consumer.receive(timeout=0).id == "id2", "the next batch was polled"


def test_a_batch_polled_while_closing_is_handed_back_at_once():
    fake = FakeShareConsumer([[FakeRecord(1, 1), FakeRecord(2, 1)]])
    consumer = poller(fake, lambda letters: None)
    original = fake.poll

    def poll_then_close(timeout: float) -> list[Any]:
        consumer._stopping.set()  # as close() does while the poller waits in poll()
        return original(timeout)

    fake.poll = poll_then_close
    consumer.round()
    consumer.round()
    assert fake.acks == [(1, AcknowledgeType.RELEASE), (2, AcknowledgeType.RELEASE)] and consumer.in_progress == 0


class FailingPolls(FakeShareConsumer):
    """A client whose next polls raise the errors it is given, then hands out its batches."""

    def __init__(self, batches: list[list[Any]], failures: list[KafkaError]) -> None:
        super().__init__(batches)
        self.failures = failures

    def poll(self, timeout: float) -> list[Any]:
        if self.failures:
            raise KafkaException(self.failures.pop(0))
        return super().poll(timeout)


def test_a_poll_that_fails_is_waited_through_and_a_client_failed_for_good_is_replaced():
    """A broker restart ends no share consumer: a poll's transient error is a wait; a fatal one replaces the client
    (the buffered records were the old one's: Kafka hands them out again when their locks end)."""
    transport = KafkaError(KafkaError._TRANSPORT, "Broker transport failure")
    fatal = KafkaError(KafkaError._FATAL, "the client failed for good", fatal=True)
    old = FailingPolls([[FakeRecord(1, 1), FakeRecord(2, 1)]], [])
    new = FailingPolls([[FakeRecord(1, 2)]], [])
    built = iter([new])
    consumer = ShareQueueConsumer(QueueConfig(limits=LIMITS), "q", dead_letters=lambda letters: None,
                                  consumer_factory=lambda config: next(built))
    consumer._consumer = old  # as open() leaves it, without Kafka
    consumer.round()
    assert consumer.receive(timeout=0) is not None, "the first record is handed out"
    old.failures = [transport]
    consumer._poll()
    assert consumer.waiting_for() is not None and consumer._consumer is old, "a transient error is waited through"
    old.failures = [fatal]
    consumer._poll()
    assert consumer._consumer is new and old.closed, "a client failed for good is replaced"
    assert consumer._state.buffered == deque() and list(consumer._state.held) == [(0, 1)], \
        "the old client's buffered record is dropped; the received one is still the application's"
    with pytest.raises(KafkaException, match="not allowed"):
        consumer._failed(KafkaException(KafkaError(KafkaError.GROUP_AUTHORIZATION_FAILED, "not allowed")))
