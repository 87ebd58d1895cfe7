"""Deliberate bugs in the share backend, to show its simulator has teeth (run and listed by tests/sim/mutations.py).

Each is a small change to the real code, as a subclass of ShareState (share_state.py) or of
ShareQueueConsumer, or the share group's settings. The last three are the simulator's own finds, put back.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable
from typing import Any

from confluent_kafka import IllegalStateException

from outbox.queue.config import QueueLimits
from outbox.queue.consumer_state import Delivery
from outbox.queue.share_consumer import _ACK_TYPES, ShareQueueConsumer
from outbox.queue.share_state import Ack, Outcome, Settling, ShareState, Verdict, group_settings
from tests.sim.share_process import ShareOptions


class RejectsBeforeTheLetter(ShareQueueConsumer):
    """REJECTs (and commits) the dead letters' records first, then writes the letters."""

    def _acknowledge(self, due: list[Settling]) -> None:
        for settling in due:
            if settling.verdict.dead_letter:
                try:
                    self._consumer.acknowledge_offset(self.topic, *settling.delivery.ref, _ACK_TYPES[Ack.REJECT])
                except IllegalStateException:
                    pass  # REJECTed at an earlier try
        self._consumer.commit_async()
        super()._acknowledge(due)


class NoExpiry(ShareState):
    """Hands out buffered records however close their lock is to its end (no release of them unhandled)."""

    def expire_buffered(self, now: float) -> int:
        return 0


class _Shifted(ShareState):
    """Runs one of ShareState's decisions with max_deliveries moved by `shift`."""

    shift = 0

    def _shifted(self) -> QueueLimits:
        assert self.limits.max_deliveries is not None
        return dataclasses.replace(self.limits, max_deliveries=self.limits.max_deliveries + self.shift)


class DeadOnArrivalLate(_Shifted):
    """Dead on arrival only past max_deliveries + 1: a record whose consumer died on its last delivery is handled
    once more."""

    shift = 1

    def arrived(self, deliveries: Iterable[Delivery]) -> list[Delivery]:
        limits, self.limits = self.limits, self._shifted()
        try:
            return super().arrived(deliveries)
        finally:
            self.limits = limits


class DeadOnArrivalEarly(DeadOnArrivalLate):
    """Dead on arrival at max_deliveries: its last delivery never reaches the handler."""

    shift = -1


class LastFailureReleased(_Shifted):
    """A failure on the max_deliveries-th delivery is RELEASEd, as if one more were allowed."""

    shift = 1

    def settle(self, delivery: Delivery, outcome: Outcome, now: float, delay: float = 0.0) -> Verdict | None:
        limits, self.limits = self.limits, self._shifted()
        try:
            return super().settle(delivery, outcome, now, delay)
        finally:
            self.limits = limits


class ImmediateAtZero(ShareState):
    """An immediate verdict meant local time 0.0 (before the fix): on a clock below 0 it waits for 0."""

    def settle(self, delivery: Delivery, outcome: Outcome, now: float, delay: float = 0.0) -> Verdict | None:
        decided = super().settle(delivery, outcome, now, delay)
        if decided is not None and decided.at is None and now < 0 and self.due and self.due[-1].delivery is delivery:
            self._sequence += 1
            heapq.heappush(self.later, (0.0, self._sequence, self.due.pop()))
        return decided


class LetterFailureReleasedAtOnce(ShareState):
    """A dead letter that could not be written: its record RELEASEd at once (before the fix), spending a delivery."""

    def letters_failed(self, settlings: list[Settling], now: float) -> list[Settling]:
        return [Settling(settling.delivery, Verdict(Ack.RELEASE)) for settling in settlings]


class LockFromTheHandOut(ShareState):
    """Counts a Retry's lock from the hand-out (receive()), not from the fetch (before the fix): a record that
    waited in the batch is held past its lock's end."""

    def settle(self, delivery: Delivery, outcome: Outcome, now: float, delay: float = 0.0) -> Verdict | None:
        fetched, delivery.last_marker = delivery.last_marker, delivery.received_at
        try:
            return super().settle(delivery, outcome, now, delay)
        finally:
            delivery.last_marker = fetched


def _with_state(state: type[ShareState]) -> type[ShareQueueConsumer]:
    class Consumer(ShareQueueConsumer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._state = state(self.queue, self.limits)
    Consumer.__name__ = f"ShareQueueConsumer with {state.__name__}"
    return Consumer


def latest_start(limits: QueueLimits) -> dict[str, str]:
    """The share group left at Kafka's default start offset (the latest)."""
    return {k: v for k, v in group_settings(limits).items() if k != "share.auto.offset.reset"}


SHARE_MUTATIONS: dict[str, ShareOptions] = {
    "a share record REJECTed before its dead letter is written": ShareOptions(consumer_class=RejectsBeforeTheLetter),
    "buffered share records handed out however near their lock's end": ShareOptions(
        consumer_class=_with_state(NoExpiry)),
    "a share record dead on arrival only past max_deliveries + 1": ShareOptions(
        consumer_class=_with_state(DeadOnArrivalLate)),
    "a share record dead on arrival at max_deliveries": ShareOptions(consumer_class=_with_state(DeadOnArrivalEarly)),
    "a share handler's failure on the last delivery RELEASEd": ShareOptions(
        consumer_class=_with_state(LastFailureReleased)),
    "the share group left at Kafka's default start offset (latest)": ShareOptions(group_settings=latest_start),
    # The simulator's finds (docs/simulation.md), put back.
    "a share verdict for now meant local time 0.0": ShareOptions(consumer_class=_with_state(ImmediateAtZero)),
    "a share record whose dead letter failed RELEASEd at once": ShareOptions(
        consumer_class=_with_state(LetterFailureReleasedAtOnce)),
    "a share Retry's lock counted from the hand-out, not the fetch": ShareOptions(
        consumer_class=_with_state(LockFromTheHandOut)),
}
