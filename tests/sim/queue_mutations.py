"""Deliberate bugs in the queue, to show its simulator has teeth (run and listed by tests/sim/mutations.py).

Each is a small change to the real code, as a subclass: the tracker's state of a markers
partition (tracker_state.py), the tracker, the consumer or its state, or the handling of a
handler's outcome. Three are the simulator's own finds, put back: the first two and the
foreign offsets' one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import TopicPartition

from outbox.queue import handling
from outbox.queue.consumer_state import ConsumerState, FetchPlan, Plan, StartBatch
from outbox.queue.markers import Kind, Marker
from outbox.queue.markers_consumer import Message, QueueConsumer, Wait
from outbox.queue.tracker import RedeliveryTracker
from outbox.queue.tracker_state import Due, PartitionTracker
from outbox.queue.transactional import TransactionalWriter
from tests.sim.queue_process import ConsumerOptions, TrackerOptions
from tests.sim.queue_scenario import QueueOptions


class EndIsTheStableOffset(RedeliveryTracker):
    """Takes the end a read_committed consumer can read to (the last stable offset) for the end of the
    partition, though an open transaction may hide KeepAlives and End markers past it (the tracker
    before the simulator took the end-of-partition event for it; here, the queried watermark)."""

    def _high_watermark(self, partition: int) -> int | None:
        return self._consumer.get_watermark_offsets(TopicPartition(self.config.markers_topic, partition),
                                                    timeout=1.0)[1]


class DueWhileReplaying(PartitionTracker):
    """Hands out what is due by the markers read so far, before the partition is rebuilt."""

    def due(self, now: float) -> list[Due]:
        rebuilt, self._rebuilt = self._rebuilt, True
        try:
            return super().due(now)
        finally:
            self._rebuilt = rebuilt


class IgnoresKeepAlives(PartitionTracker):
    """Takes no notice of KeepAlive markers: the deadline stays the Start's."""

    def apply(self, queue: str, marker: Marker, offset: int, timestamp: float, now: float) -> None:
        if marker.kind is Kind.KEEPALIVE:
            self.advance(offset, timestamp, now)
            return
        super().apply(queue, marker, offset, timestamp, now)


class DeadLettersEarly(PartitionTracker):
    """Dead-letters a message one delivery before its max_deliveries."""

    def apply(self, queue: str, marker: Marker, offset: int, timestamp: float, now: float) -> None:
        if marker.kind is Kind.START and marker.max_deliveries is not None:
            marker = dataclasses.replace(marker, max_deliveries=marker.max_deliveries - 1)
        super().apply(queue, marker, offset, timestamp, now)


class CommitsPastInProgress(PartitionTracker):
    """Commits the offset of the next marker, not that of the oldest Start still in progress."""

    def commit_offset(self) -> int | None:
        return self._next_offset


def _tracker(state: type[PartitionTracker]) -> type[RedeliveryTracker]:
    class Tracker(RedeliveryTracker):
        def _on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
            super()._on_assign(consumer, partitions)
            for tp in partitions:
                self._trackers[tp.partition] = state(tp.partition)
    return Tracker


class CommitsBeforeStarting(QueueConsumer):
    """Commits the consumer's offsets on their own, then writes the Start markers in a transaction
    (kafka-mq-go's scenario 3: a crash in between loses the batch)."""

    def _start(self, batch: StartBatch) -> Wait:
        self._consumer.commit(offsets=[TopicPartition(self.config.topic, p, o) for p, o in batch.offsets.items()],
                              asynchronous=False)
        return super()._start(dataclasses.replace(batch, offsets={}))


class KeepsForeignOffsets(ConsumerState):
    """Keeps the offsets past other queues' records of a partition taken away, and commits them later
    (as the consumer did before the simulator): the group's offset goes back."""

    def revoked(self, partitions: Iterable[int]) -> None:
        return


class CommitsForeignOffsetsOfLostPartitions(QueueConsumer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._state = KeepsForeignOffsets(self.queue, self.limits, self._clock())


class NoBackPressure(ConsumerState):
    """Reads on when max_in_progress messages are held."""

    def fetch_plan(self, now: float) -> FetchPlan:
        plan = super().fetch_plan(now)
        return plan if plan.plan is Plan.READ else FetchPlan(Plan.READ, 1, self.paused)


class ReadsPastItsRoom(QueueConsumer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._state = NoBackPressure(self.queue, self.limits, self._clock())


class EndsOnAFatalError(TransactionalWriter):
    """Raises a fatal error of its producer (the process ends) instead of replacing the producer."""

    def _give_up(self, error: Any) -> None:
        raise error


def _ending_on_fatal_errors(writer: TransactionalWriter) -> TransactionalWriter:
    return EndsOnAFatalError(writer._build, writer._outage, timeout=writer._timeout, caller=writer._call,
                             transactional_id=writer.transactional_id)


class ConsumerEndsOnAFatalProducerError(QueueConsumer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._starts = _ending_on_fatal_errors(self._starts)


class TrackerEndsOnAFatalProducerError(RedeliveryTracker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._redeliveries = _ending_on_fatal_errors(self._redeliveries)


def ack_inside_the_transaction(message: Message, handler: handling.Handler,
                               inbox: handling.Inbox | None = None) -> handling.Outcome:
    """Sends the End marker before the handler's transaction (with its inbox row) has committed."""
    def acked_at_once(message: Message) -> None:
        handler(message)
        message.ack()
    return handling.handle(message, acked_at_once, inbox)


def _consumer(consumer_class: type[QueueConsumer] = QueueConsumer,
              handle: Callable[..., handling.Outcome] = handling.handle, **options: Any) -> QueueOptions:
    return QueueOptions(consumer=ConsumerOptions(consumer_class, handle), **options)


QUEUE_MUTATIONS: dict[str, QueueOptions] = {
    "a tracker that takes the last stable offset for the end of its partition":
        QueueOptions(tracker=TrackerOptions(EndIsTheStableOffset)),
    "a tracker that redelivers before reading its partition to the end":
        QueueOptions(tracker=TrackerOptions(_tracker(DueWhileReplaying))),
    "a tracker that ignores KeepAlives": QueueOptions(tracker=TrackerOptions(_tracker(IgnoresKeepAlives))),
    "dead-lettering one delivery early": QueueOptions(tracker=TrackerOptions(_tracker(DeadLettersEarly))),
    "a tracker that commits past messages in progress":
        QueueOptions(tracker=TrackerOptions(_tracker(CommitsPastInProgress))),
    "the End marker sent before the handler's transaction committed (the inbox)":
        _consumer(handle=ack_inside_the_transaction, inbox=True),
    "a consumer that commits its offsets before writing the Start markers": _consumer(CommitsBeforeStarting),
    "a consumer that reads on when max_in_progress messages are held": _consumer(ReadsPastItsRoom),
    "a consumer that commits other queues' offsets in partitions taken from it":
        _consumer(CommitsForeignOffsetsOfLostPartitions),
    "a consumer that ends on a fatal error of its transactional producer": _consumer(ConsumerEndsOnAFatalProducerError),
    "a tracker that ends on a fatal error of its transactional producer":
        QueueOptions(tracker=TrackerOptions(TrackerEndsOnAFatalProducerError)),
}
