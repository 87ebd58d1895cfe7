"""A share-group consumer (share_groups.py) with confluent_kafka.ShareConsumer's interface, explicit mode.

What ShareQueueConsumer uses is modelled: subscribe(), poll() (a batch of acquired records, each
with its delivery count; IllegalStateException while a record of the last batch is unacknowledged),
acknowledge_offset() (local state only; IllegalStateException for a record not in flight),
commit_async() (the acknowledgements travel to the broker and are applied, or refused, a moment
later; the request may fail), the acknowledgement commit callback (served inside the next call, on
the caller's thread, as librdkafka does), and close() (acknowledgements sent, then the group left).

`max.poll.records` is a soft limit in librdkafka 2.16: `fetch_limit` says how many records a poll
may bring. A poll that finds nothing adds its timeout to `blocked`, as MemoryConsumer does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from confluent_kafka import AcknowledgeType, IllegalStateException, KafkaError, KafkaException, TopicPartition

from outbox.kafka.memory.broker import MemoryBroker
from outbox.kafka.memory.share_groups import Acquired, ShareGroup, ShareMember, Standing, share_group

_ACKS = {AcknowledgeType.ACCEPT: "accept", AcknowledgeType.RELEASE: "release", AcknowledgeType.REJECT: "reject"}


class ShareRecord:
    """A record as a share consumer's poll returns it: confluent_kafka.Message's accessors, with its delivery count."""

    def __init__(self, acquired: Acquired) -> None:
        self._record, self._deliveries = acquired.record, acquired.deliveries

    def error(self) -> KafkaError | None:
        return None

    def topic(self) -> str:
        return str(self._record.topic())

    def partition(self) -> int:
        return int(self._record.partition())

    def offset(self) -> int:
        return int(self._record.offset())

    def key(self) -> bytes | None:
        return self._record.key()  # type: ignore[no-any-return]

    def value(self) -> bytes | None:
        return self._record.value()  # type: ignore[no-any-return]

    def headers(self) -> list[tuple[str, bytes | None]]:
        return self._record.headers()  # type: ignore[no-any-return]

    def delivery_count(self) -> int:
        return self._deliveries


class MemoryShareConsumer:
    def __init__(self, broker: MemoryBroker, config: dict[str, Any], *, name: str = "share-consumer",
                 alive: Callable[[], bool] = lambda: True, checkpoint: Callable[[], None] = lambda: None,
                 fetch_limit: Callable[[int], int] = lambda most: most, ack_lost: Callable[[], bool] = lambda: False,
                 acquired_ago: Callable[[], float] = lambda: 0.0) -> None:
        self.broker, self.world = broker, broker.world
        self.group_id = str(config["group.id"])
        assert config.get("share.acknowledgement.mode") == "explicit", "ShareQueueConsumer acknowledges explicitly"
        self.max_poll_records = int(config.get("max.poll.records", 500))
        #: Called at every call into the client: the simulator's crash points.
        self.checkpoint = checkpoint
        self.fetch_limit, self.ack_lost, self.acquired_ago = fetch_limit, ack_lost, acquired_ago
        self.member = ShareMember(name, alive)
        self.group: ShareGroup | None = None
        self.topic = ""
        #: (partition, offset) -> acquisition, for the records of the last poll not yet acknowledged.
        self._in_flight: dict[tuple[int, int], int] = {}
        self._pending: list[tuple[int, int, int, str]] = []
        self._answers: list[tuple[dict[TopicPartition, set[int]], KafkaException | None]] = []
        self._callback: Callable[[dict[TopicPartition, set[int]], KafkaException | None], None] | None = None
        self.closed = False
        #: Seconds poll() would have blocked finding nothing (the simulator's clock reads it).
        self.blocked = 0.0

    def subscribe(self, topics: list[str]) -> None:
        self.checkpoint()
        (self.topic,) = topics
        self.group = share_group(self.broker, self.group_id, self.topic)
        self.group.join(self.member)

    def set_acknowledgement_commit_callback(self, callback: Any) -> None:
        self._callback = callback

    def poll(self, timeout: float = -1) -> list[ShareRecord]:
        self.checkpoint()
        self._usable()
        self._serve()
        if self._in_flight:
            raise IllegalStateException("not all records from the previous poll have been acknowledged")
        group = self._joined()
        self._send()  # acknowledgements ride on the fetch
        found = group.fetch(self.member, self.fetch_limit(self.max_poll_records), self.acquired_ago())
        if not found:
            self.blocked += max(timeout, 0.0)
            return []
        self._in_flight = {(a.partition, a.offset): a.acquisition for a in found}
        return [ShareRecord(a) for a in found]

    def acknowledge_offset(self, topic: str, partition: int, offset: int,
                           ack_type: AcknowledgeType = AcknowledgeType.ACCEPT) -> None:
        self.checkpoint()
        self._usable()
        acquisition = self._in_flight.pop((partition, offset), None)
        if topic != self.topic or acquisition is None:
            raise IllegalStateException(f"{topic} [{partition}] offset {offset} is not in flight")
        self._pending.append((partition, offset, acquisition, _ACKS[ack_type]))

    def commit_async(self) -> None:
        self.checkpoint()
        self._usable()
        self._serve()
        self._send()

    def close(self) -> None:
        self.checkpoint()
        if self.closed:
            return
        self.closed = True
        if self.group is not None:  # the acknowledgements are answered, then the member leaves
            group, member = self.group, self.member
            self._send(then=lambda: group.leave(member))
        self._serve()

    # -- inside ---------------------------------------------------------------------------------------

    def _usable(self) -> None:
        if self.closed:
            raise IllegalStateException("the share consumer is closed")

    def _joined(self) -> ShareGroup:
        """The group, heard from at this call; a member whose session expired joins again, as a new one."""
        assert self.group is not None, "poll() before subscribe()"
        if self.member.standing is not Standing.MEMBER:
            self.group.join(self.member)
        self.group.heard(self.member)
        return self.group

    def _send(self, then: Callable[[], None] = lambda: None) -> None:
        """The pending acknowledgements go to the broker: applied a moment later, one request (that may fail)."""
        if self.group is None:
            return
        sent, self._pending = self._pending, []
        if not sent:
            self.world.after(self.world.latency(0.001, 0.02), then)
            return
        group, member, lost = self.group, self.member, self.ack_lost()

        def arrive() -> None:
            refused = []
            for partition, offset, acquisition, ack in sent:
                if not group.acknowledge(member, partition, offset, acquisition, ack, lost=lost):
                    refused.append((partition, offset))
            offsets: dict[TopicPartition, set[int]] = {}
            for partition, offset in refused or [(p, o) for p, o, _, _ in sent]:
                offsets.setdefault(TopicPartition(self.topic, partition), set()).add(offset)
            error = None
            if refused:
                error = KafkaException(KafkaError(KafkaError.REQUEST_TIMED_OUT if lost else
                                                  KafkaError.INVALID_RECORD_STATE,
                                                  "the acknowledgement request failed" if lost else
                                                  "the record is not acquired by this member"))
            self._answers.append((offsets, error))
            then()
        self.world.after(self.world.latency(0.001, 0.02), arrive)

    def _serve(self) -> None:
        answers, self._answers = self._answers, []
        if self._callback is not None:
            for offsets, error in answers:
                self._callback(offsets, error)
