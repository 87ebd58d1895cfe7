"""A Kafka consumer in a consumer group (groups.py), with confluent_kafka.Consumer's interface.

What the queue's consumers and trackers and the harvester's leader elections use is modelled: subscribe() with
rebalance callbacks (served inside poll() and consume(), as librdkafka serves them; an assignment the callback did
not apply itself is applied after it, and a revoked one taken away; a callback that raised, as the simulator's
thread blocked in it does, is called again at the next poll and its event is served only once it returned),
auto.offset.reset (librdkafka's default, latest, where nothing was committed), incremental assignment,
pause and resume, seek, synchronous commits (refused for a stale generation or a member the group
dropped) and the committed offsets, consumer_group_metadata() for transactions, read_committed isolation (nothing at or
past the last stable offset, nothing aborted, no control records), get_watermark_offsets() (the
high watermark, past open transactions), position() (the offset after the last record returned;
records skipped do not move it), and the end-of-partition event as librdkafka gives it (measured
against Kafka 4.1.1): once per offset, only after the partition sat at its end for
fetch.wait.max.ms with nothing new (so never under steady traffic), and it moves the position to
the end (past a transaction's control record).

Records come straight from the logs: a poll sees everything visible at that moment. Nothing
blocks: a poll that finds nothing adds its timeout to `blocked`, which the simulator reads to
know how long the real call would have waited.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from outbox.kafka.memory.broker import MemoryBroker, StoredMessage
from outbox.kafka.memory.groups import TP, ConsumerGroup, GroupMember, GroupMetadata, Standing

Callback = Callable[[Any, list[TopicPartition]], None]


def _tps(partitions: list[TP]) -> list[TopicPartition]:
    return [TopicPartition(topic, partition) for topic, partition in partitions]


class MemoryConsumer:
    def __init__(self, broker: MemoryBroker, config: dict[str, Any], *, name: str = "consumer",
                 alive: Callable[[], bool] = lambda: True, checkpoint: Callable[[], None] = lambda: None) -> None:
        self.broker = broker
        self.world = broker.world
        self.group_id = str(config["group.id"])
        self.read_committed = config.get("isolation.level") == "read_committed"
        self.from_earliest = config.get("auto.offset.reset", "latest") in ("earliest", "smallest", "beginning")
        self.partition_eof = bool(config.get("enable.partition.eof", False))
        self.session_timeout = float(config.get("session.timeout.ms", 45_000)) / 1000
        self.fetch_wait = float(config.get("fetch.wait.max.ms", 500)) / 1000
        #: Called at every call into the client: the simulator's crash points.
        self.checkpoint = checkpoint
        self.member = GroupMember(name, alive)
        self.group: ConsumerGroup | None = None
        self.positions: dict[TP, int] = {}
        self.paused: set[TP] = set()
        self._eof_at: dict[TP, int] = {}  # the end is reported once per offset it is reached at
        self._at_end_since: dict[TP, float] = {}
        self._returned: dict[TP, int] = {}  # position(): after the last record returned (or an end event after one)
        self._callbacks: dict[str, Callback | None] = {}
        self._noticed_at: float | None = None  # dropped: when it will notice (a round trip after it can talk)
        self._turn = 0
        self.closed = False
        #: Seconds poll() and consume() would have blocked finding nothing (the simulator's clock reads it).
        self.blocked = 0.0

    # -- the group --------------------------------------------------------------------------------

    def subscribe(self, topics: list[str], on_assign: Callback | None = None, on_revoke: Callback | None = None,
                  on_lost: Callback | None = None) -> None:
        self.checkpoint()
        self.group = self.broker.consumer_group(self.group_id, list(topics), self.session_timeout)
        self._callbacks = {"assign": on_assign, "revoke": on_revoke, "lost": on_lost or on_revoke}
        self.group.join(self.member)

    def _serve(self) -> None:
        """The rebalance callbacks, as librdkafka runs them inside poll()."""
        group, member = self.group, self.member
        if group is None:
            return
        if member.standing is Standing.DROPPED:
            now = self.world.now
            if self._noticed_at is None:
                self._noticed_at = now + self.world.latency(0.005, 0.05)
            if now < self._noticed_at:
                return  # a zombie for a moment: it does not know yet
            self._noticed_at = None
            lost = [tp for tp in member.lost if tp in self.positions]
            member.lost = []
            if lost:
                self._call("lost", lost)
                self._unassign(lost)
            group.join(member)  # librdkafka rejoins by itself
            return
        if not group.rejoined(member):
            return
        while member.events:
            kind, partitions = member.events[0]
            if kind == "assign":
                self._call("assign", partitions)
                member.events.popleft()
                fresh = [tp for tp in partitions if tp not in self.positions]
                if fresh:  # the callback did not assign them itself
                    self.incremental_assign(_tps(fresh))
            else:
                mine = [tp for tp in partitions if tp in self.positions]
                self._call("revoke", mine)
                member.events.popleft()
                self._unassign(mine)
                group.revoked(member, partitions)

    def _call(self, kind: str, partitions: list[TP]) -> None:
        callback = self._callbacks.get(kind)
        if callback is not None and partitions:
            callback(self, _tps(partitions))

    def assignment(self) -> list[TopicPartition]:
        return _tps(list(self.positions))

    def incremental_assign(self, partitions: list[TopicPartition]) -> None:
        assert self.group is not None
        for tp in partitions:
            key = (tp.topic, tp.partition)
            committed = self.group.committed.get(key)
            self.positions[key] = (tp.offset if tp.offset >= 0 else committed if committed is not None
                                   else self._reset_to(key))
            self._forget_reads(key)

    def _reset_to(self, tp: TP) -> int:
        """Where a partition with no committed offset starts (auto.offset.reset)."""
        if self.from_earliest:
            return 0
        return self.broker.stable_end(*tp) if self.read_committed else len(self.broker.log(tp[0])[tp[1]])

    def incremental_unassign(self, partitions: list[TopicPartition]) -> None:
        self._unassign([(tp.topic, tp.partition) for tp in partitions])

    def _unassign(self, partitions: list[TP]) -> None:
        for tp in partitions:
            self.positions.pop(tp, None)
            self.paused.discard(tp)
            self._forget_reads(tp)

    def _forget_reads(self, tp: TP) -> None:
        self._eof_at.pop(tp, None)
        self._at_end_since.pop(tp, None)
        self._returned.pop(tp, None)

    def consumer_group_metadata(self) -> GroupMetadata:
        self.checkpoint()
        assert self.group is not None
        return GroupMetadata(self.group_id, self.member, self.member.generation)

    def commit(self, message: Any = None, offsets: list[TopicPartition] | None = None,
               asynchronous: bool = True) -> list[TopicPartition] | None:
        self.checkpoint()
        if self.closed:
            raise RuntimeError("Consumer closed")
        assert self.group is not None and offsets is not None
        refusal = self.group.refusal(self.member, self.member.generation)
        if refusal is not None:
            raise KafkaException(refusal)
        self.group.commit({(tp.topic, tp.partition): tp.offset for tp in offsets})
        return None if asynchronous else offsets

    def close(self) -> None:
        """Leave the group: the revoke callback runs for what is assigned, as librdkafka's close() does."""
        self.checkpoint()
        if self.closed:
            return
        if self.group is not None and self.member.standing is Standing.MEMBER:
            mine = list(self.positions)
            self._call("revoke", mine)
            self._unassign(mine)
            self.group.leave(self.member)
        self.closed = True

    # -- reading ----------------------------------------------------------------------------------

    def poll(self, timeout: float | None = None) -> StoredMessage | None:
        found = self.consume(1, timeout)
        return found[0] if found else None

    def consume(self, num_messages: int = 1, timeout: float | None = None) -> list[StoredMessage]:
        self.checkpoint()
        if self.closed:
            raise RuntimeError("Consumer closed")
        self._serve()
        found = self._read(num_messages)
        if not found and timeout:
            self.blocked += timeout
        return found

    def _read(self, limit: int) -> list[StoredMessage]:
        found: list[StoredMessage] = []
        readable = [tp for tp in self.positions if tp not in self.paused]
        if not readable:
            return found
        self._turn += 1
        start = self._turn % len(readable)
        for tp in readable[start:] + readable[:start]:
            if len(found) >= limit:
                break
            topic, partition = tp
            log = self.broker.log(topic)[partition]
            end = self.broker.stable_end(topic, partition) if self.read_committed else len(log)
            position = self.positions[tp]
            while position < end and len(found) < limit:
                message = log[position]
                position += 1
                if message.control or (self.read_committed and message.txn is not None
                                       and message.txn.state != "committed"):
                    continue
                found.append(message)
                self._returned[tp] = position
            moved, self.positions[tp] = position != self.positions[tp], position
            if position < end:
                continue
            if moved:  # it reached the end just now
                self._at_end_since[tp] = self.world.now
            since = self._at_end_since.setdefault(tp, self.world.now)
            if self.partition_eof and self._eof_at.get(tp) != position and len(found) < limit \
                    and self.world.now - since >= self.fetch_wait:
                self._eof_at[tp] = position
                if tp in self._returned:  # as librdkafka: before any record of it, position() stays unknown
                    self._returned[tp] = position
                found.append(StoredMessage(topic, partition, position, None, None, None, error=KafkaError(
                    KafkaError._PARTITION_EOF, f"Fetch from broker reached end of partition at offset {position}")))
        return found

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused.update((tp.topic, tp.partition) for tp in partitions)

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.paused.difference_update((tp.topic, tp.partition) for tp in partitions)

    def seek(self, partition: TopicPartition) -> None:
        self.checkpoint()
        key = (partition.topic, partition.partition)
        if key not in self.positions:
            raise KafkaException(KafkaError(KafkaError._UNKNOWN_PARTITION, "Local: Unknown partition"))
        self.positions[key] = partition.offset
        self._forget_reads(key)
        self._returned[key] = partition.offset

    def committed(self, partitions: list[TopicPartition], timeout: float | None = None) -> list[TopicPartition]:
        """The group's committed offsets (OFFSET_INVALID, -1001, where none is)."""
        self.checkpoint()
        assert self.group is not None
        return [TopicPartition(tp.topic, tp.partition, self.group.committed.get((tp.topic, tp.partition), -1001))
                for tp in partitions]

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        """The offset after the last record returned, or the end event after one; OFFSET_INVALID (-1001) before any
        record (librdkafka's, measured: an end-of-partition event alone leaves it unknown)."""
        return [TopicPartition(tp.topic, tp.partition, self._returned.get((tp.topic, tp.partition), -1001))
                for tp in partitions]

    def get_watermark_offsets(self, partition: TopicPartition, timeout: float | None = None,
                              cached: bool = False) -> tuple[int, int]:
        """(low, high). Cached: the high watermark, past open transactions. Queried: for read_committed,
        the broker answers the last stable offset (as Kafka 4.1.1 does)."""
        topic, number = partition.topic, partition.partition
        if not cached and self.read_committed:
            return 0, self.broker.stable_end(topic, number)
        return 0, len(self.broker.log(topic)[number])
