"""The queue's invariants, checked as the simulated run goes (at every record, transaction and
offset commit the broker reports, at every dead letter and after every tracker step) and at its end.

The ledger watches the broker (MemoryBroker.watchers) and keeps its own account of the log, from
the records themselves, never from the consumers' or trackers' state:
- per message id: its queue records (first delivery and redeliveries);
- per delivery (a record's place, its "ref"): the round its markers open (the first Start) and
  close (an End), and the deadline the latest Start, KeepAlive or Release of the round sets.

Invariants:
- nothing lost: whenever an End marker is committed or a consumer group's or the trackers' offset
  moves, every message it concerns is handled (its handler's work committed), dead-lettered, or
  still on its way: a record not yet read past by its queue's group, or an open round whose Start
  a restarted tracker would read again (at or after the trackers' committed offset);
- a message whose End marker was committed and read by a tracker is never redelivered (nor
  dead-lettered) by it;
- a redelivery happens only after the redelivery timeout since the last Start or KeepAlive of its
  delivery the broker holds (immediately after a Release), by the broker's clock, to the
  millisecond the timestamps carry;
- max_deliveries holds: no delivery carries a count above it, and a message is dead-lettered only
  by the delivery that reached it;
- no delivery reaches a handler twice (the same message with the same delivery count): a record
  is started once, in the transaction that moves its group past it;
- a tracker that has read a partition to its end holds the messages in progress the log says,
  each from its first Start, with a deadline no earlier than the log's (a restarted tracker
  rebuilds the same state);
- back-pressure: a consumer never holds more than max_in_progress (checked by the process);
- at the end, once the faults stopped, every message is handled or dead-lettered.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from outbox.kafka.memory.broker import BROKER_EPOCH, StoredMessage
from outbox.kafka.memory.groups import TP
from outbox.kafka.memory.world import Violation, World
from outbox.queue import markers
from outbox.queue.config import QueueConfig
from outbox.queue.markers import Kind, Marker, MarkerError, Ref
from outbox.queue.tracker import DeadLetter

#: Timestamps are whole milliseconds: a deadline may be met up to one early.
MS = 1


def _seconds(timestamp_ms: int) -> str:
    """A broker timestamp as the simulated time it was taken at."""
    return f"t={timestamp_ms / 1000 - BROKER_EPOCH:.3f}"


@dataclass
class Round:
    """One delivery's markers, from its first Start to an End."""

    partition: int  # of the markers topic
    start_offset: int
    start: Marker
    deadline_ms: int
    last: tuple[str, int, float]  # what set the deadline (kind, timestamp, seconds after), for the messages
    ended_at: int | None = None  # the End marker's offset


@dataclass
class Ledger:
    world: World
    config: QueueConfig
    #: message id -> queue (the senders fill it in)
    sent: dict[str, str] = field(default_factory=dict)
    handled: dict[str, int] = field(default_factory=dict)
    dead: dict[str, DeadLetter] = field(default_factory=dict)
    #: (producer, markers partition) -> the offset that producer's tracker has read up to, or None
    reader_position: Callable[[Any, int], int | None] = lambda producer, partition: None
    #: the first invariant broken (raising may be swallowed by the code under test: this is not)
    violation: str | None = None
    records: dict[str, list[Ref]] = field(default_factory=lambda: defaultdict(list))
    ref_ids: dict[Ref, str] = field(default_factory=dict)
    by_partition: dict[int, list[tuple[int, str]]] = field(default_factory=lambda: defaultdict(list))
    rounds: dict[Ref, Round] = field(default_factory=dict)
    #: (message id, deliveries) -> the consumer that handed it to a handler
    handed_to: dict[tuple[str, int], str] = field(default_factory=dict)
    #: group -> its committed offsets, as reported
    offsets: dict[str, dict[TP, int]] = field(default_factory=dict)
    redelivered: int = 0

    # -- the broker's reports ---------------------------------------------------------------------

    def visible(self, messages: list[StoredMessage]) -> None:
        """Records appended outside a transaction (readable once the partition's stable offset passes them)."""
        for message in messages:
            self._record(message, None)

    def transaction(self, messages: list[StoredMessage], offsets: dict[str, dict[TP, int]]) -> None:
        """A transaction committed: its records and its offsets, at once."""
        producer = messages[0].txn.producer if messages else None
        for message in messages:
            self._record(message, producer)
        for group, changes in offsets.items():
            self.committed(group, changes)

    def committed(self, group: str, offsets: dict[TP, int]) -> None:
        """A group's offsets moved (a consumer's own commit, or with a transaction)."""
        before = self.offsets.setdefault(group, {})
        moved = {tp: (before.get(tp, 0), offset) for tp, offset in offsets.items()}
        before.update(offsets)
        self._offsets_moved(group, moved)

    def handed(self, consumer: str, message_id: str, deliveries: int) -> None:
        """A worker got the message from receive()."""
        earlier = self.handed_to.get((message_id, deliveries))
        if earlier is not None:
            self.fail(f"delivery {deliveries} of message {message_id} reached a handler twice ({earlier}, then "
                      f"{consumer})")
        self.handed_to[(message_id, deliveries)] = consumer

    def dead_lettered(self, letter: DeadLetter) -> None:
        limit = self.config.limits_for(letter.queue).max_deliveries
        if limit is None or letter.deliveries != limit:
            self.fail(f"message {letter.message_id} dead-lettered after {letter.deliveries} deliveries "
                      f"(max_deliveries {limit})")
        self.dead[letter.message_id] = letter
        self.world.note(f"{letter.message_id} dead-lettered after {letter.deliveries} deliveries")

    # -- the account ------------------------------------------------------------------------------

    def _record(self, message: StoredMessage, producer: Any) -> None:
        topic = message.topic()
        if topic == self.config.topic:
            self._queue_record(message)
        elif topic == self.config.markers_topic:
            try:
                marker = markers.decode(message.value(), message.headers())
            except MarkerError:
                return
            self._marker(message, marker, producer)

    def _queue_record(self, message: StoredMessage) -> None:
        headers = message.headers()
        message_id = markers.header_text(headers, markers.ID_HEADER)
        if message_id is None or message_id not in self.sent:
            return
        ref = (message.partition(), message.offset())
        self.records[message_id].append(ref)
        self.ref_ids[ref] = message_id
        self.by_partition[ref[0]].append((ref[1], message_id))
        deliveries = markers.deliveries_of(headers)
        limit = self.config.limits_for(self.sent[message_id]).max_deliveries
        if limit is not None and deliveries > limit:
            self.fail(f"message {message_id} delivered a {deliveries}th time (max_deliveries {limit})")

    def _marker(self, message: StoredMessage, marker: Marker, producer: Any) -> None:
        ref, partition, offset = marker.ref, message.partition(), message.offset()
        at_ms = message.timestamp()[1]
        current = self.rounds.get(ref)
        is_open = current is not None and current.ended_at is None
        if marker.kind is Kind.START:
            if not is_open:
                self.rounds[ref] = Round(partition, offset, marker, at_ms + round(marker.redeliver_after * 1000),
                                         ("Start", at_ms, marker.redeliver_after))
            else:
                assert current is not None
                current.deadline_ms = at_ms + round(marker.redeliver_after * 1000)
                current.last = ("second Start", at_ms, marker.redeliver_after)
        elif marker.kind is Kind.KEEPALIVE and is_open:
            assert current is not None
            current.deadline_ms = at_ms + round(marker.redeliver_after * 1000)
            current.last = ("KeepAlive", at_ms, marker.redeliver_after)
        elif marker.kind is Kind.RELEASE and is_open:
            assert current is not None
            current.deadline_ms, current.last = at_ms, ("Release", at_ms, 0.0)
        elif marker.kind is Kind.END:
            if producer is not None:  # a tracker's: a redelivery or a dead letter
                self._redelivery(ref, current, at_ms, offset, producer)
            if is_open:
                assert current is not None
                current.ended_at = offset
            message_id = self.ref_ids.get(ref)
            if message_id is not None:
                self._still_there(message_id, f"after the End marker of its delivery at {ref}")

    def _redelivery(self, ref: Ref, current: Round | None, at_ms: int, offset: int, producer: Any) -> None:
        """A tracker's End marker, committed with the redelivery (or after the dead letter) it closes."""
        self.redelivered += 1
        message_id = self.ref_ids.get(ref, f"at {ref}")
        if self.world.keep_trace:
            self.world.note(f"a tracker ended delivery {ref} of {message_id} (redelivered or dead-lettered)")
        if current is None:
            return  # a Start that never committed: nothing to check the deadline against
        if current.ended_at is not None:
            read = self.reader_position(producer, current.partition)
            if read is not None and read > current.ended_at:
                self.fail(f"message {message_id} redelivered though the End marker of its delivery {ref} "
                          f"(markers {current.partition}:{current.ended_at}) was committed and read")
            return
        if at_ms < current.deadline_ms - MS:
            self.fail(f"message {message_id} redelivered at {_seconds(at_ms)}, {current.deadline_ms - at_ms} ms before "
                      f"its deadline, set by its {current.last[0]} at {_seconds(current.last[1])} "
                      f"(+{current.last[2]:g}s)")

    def _offsets_moved(self, group: str, moved: dict[TP, tuple[int, int]]) -> None:
        if group == self.config.tracker_group:
            for (_, partition), (_, offset) in moved.items():
                for ref, current in self.rounds.items():
                    if current.partition == partition and current.ended_at is None and current.start_offset < offset:
                        self.fail(f"the trackers committed markers offset {partition}:{offset}, past the Start of "
                                  f"delivery {ref} (at {current.start_offset}), still in progress: a restarted "
                                  f"tracker would never redeliver it")
            return
        prefix = self.config.consumer_group_prefix
        queue = group[len(prefix):] if group.startswith(prefix) else None
        for (topic, partition), (before, offset) in moved.items():
            if topic != self.config.topic:
                continue
            for record_offset, message_id in self.by_partition.get(partition, ()):
                if before <= record_offset < offset and self.sent[message_id] == queue:
                    self._still_there(message_id, f"after group {group} committed {partition}:{offset}")

    def _still_there(self, message_id: str, when: str) -> None:
        """Nothing lost: handled, dead-lettered, or on its way."""
        if message_id in self.handled or message_id in self.dead or self._on_its_way(message_id):
            return
        self.fail(f"message {message_id} is nowhere {when}: not handled, not dead-lettered, no record left unread "
                  f"by its group and no delivery in progress a restarted tracker would find")

    def _on_its_way(self, message_id: str) -> bool:
        group = self.offsets.get(self.config.consumer_group(self.sent[message_id]), {})
        trackers = self.offsets.get(self.config.tracker_group, {})
        for ref in self.records.get(message_id, ()):
            if ref[1] >= group.get((self.config.topic, ref[0]), 0):
                return True
            current = self.rounds.get(ref)
            if current is not None and current.ended_at is None \
                    and current.start_offset >= trackers.get((self.config.markers_topic, current.partition), 0):
                return True
        return False

    # -- the trackers' state ----------------------------------------------------------------------

    def check_rebuilt(self, name: str, states: dict[int, Any], positions: dict[int, int], log: Callable[[int], list],
                      seen: set[int]) -> None:
        """A tracker that read a partition to its end holds exactly the deliveries in progress the log says."""
        for partition, state in states.items():
            if not state.rebuilt or id(state) in seen or partition not in positions:
                continue
            seen.add(id(state))
            expected = self._replay(log(partition)[:positions[partition]])
            actual = state.in_progress
            if set(actual) != set(expected):
                missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
                self.fail(f"{name} rebuilt markers partition {partition} wrongly: missing {missing[:5]}, "
                          f"extra {extra[:5]}")
            for ref, entry in actual.items():
                offset, deadline = expected[ref]
                if entry.marker_offset != offset:
                    self.fail(f"{name} holds delivery {ref} from markers offset {entry.marker_offset}, the log from "
                              f"{offset}")
                if not entry.due and entry.deadline < deadline - 1e-9:
                    self.fail(f"{name} rebuilt delivery {ref} with its deadline {deadline - entry.deadline:.3f}s "
                              f"early (a KeepAlive or Start not taken into account)")

    @staticmethod
    def _replay(log: list[StoredMessage]) -> dict[Ref, tuple[int, float]]:
        """Deliveries in progress in a markers partition: ref -> (first Start's offset, deadline in seconds)."""
        found: dict[Ref, tuple[int, float]] = {}
        for message in log:
            if message.control or (message.txn is not None and message.txn.state != "committed"):
                continue
            try:
                marker = markers.decode(message.value(), message.headers())
            except MarkerError:
                continue
            at = message.timestamp()[1] / 1000
            ref = marker.ref
            if marker.kind is Kind.START:
                first = found[ref][0] if ref in found else message.offset()
                found[ref] = (first, at + marker.redeliver_after)
            elif marker.kind is Kind.KEEPALIVE and ref in found:
                found[ref] = (found[ref][0], at + marker.redeliver_after)
            elif marker.kind is Kind.RELEASE and ref in found:
                found[ref] = (found[ref][0], at)
            elif marker.kind is Kind.END:
                found.pop(ref, None)
        return found

    # -- the end ------------------------------------------------------------------------------------

    def check_settled(self, exempt: set[str]) -> None:
        """Once the faults stopped, every message was handled or dead-lettered."""
        left = [m for m in self.sent if m not in self.handled and m not in self.dead and m not in exempt]
        if left:
            self.fail(f"{len(left)} message(s) never handled nor dead-lettered, e.g. {left[:3]}")

    def fail(self, text: str) -> None:
        if self.violation is None:
            self.violation = f"t={self.world.now:.3f}: {text}"
        raise Violation(text)
