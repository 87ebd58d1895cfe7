"""The redelivery tracker's state for one markers partition, on a simulated clock.

Marker timestamps are the broker's (seconds); `now` is the tracker's local monotonic clock.
"""

from __future__ import annotations

import pytest

from outbox.queue.markers import DELIVERIES_HEADER, ID_HEADER, Kind, Marker
from outbox.queue.tracker_state import PartitionTracker

TIMEOUT = 10.0


def start(offset: int, *, deliveries: int = 1, max_deliveries: int | None = 3, after: float = TIMEOUT) -> Marker:
    headers = ((ID_HEADER, f"m{offset}".encode()), (DELIVERIES_HEADER, str(deliveries).encode()))
    return Marker(Kind.START, (0, offset), after, key=b"q", payload=f"body {offset}".encode(), headers=headers,
                  max_deliveries=max_deliveries)


def keep_alive(offset: int, after: float = TIMEOUT) -> Marker:
    return Marker(Kind.KEEPALIVE, (0, offset), after)


def end(offset: int) -> Marker:
    return Marker(Kind.END, (0, offset))


class Log:
    """Feeds markers to a tracker at consecutive offsets of the markers partition."""

    def __init__(self) -> None:
        self.tracker = PartitionTracker(partition=0)
        self.offset = 0

    def add(self, marker: Marker, timestamp: float, now: float, queue: str = "q") -> int:
        offset = self.offset
        self.tracker.apply(queue, marker, offset, timestamp, now)
        self.offset += 1
        return offset

    def at_end(self, hidden: int = 0) -> None:
        """Read to the end; or `hidden` records lie past the position (unread, or behind an open transaction)."""
        self.tracker.read_to(self.offset, self.offset + hidden)


def test_a_started_message_is_in_progress_until_its_end_marker():
    log = Log()
    log.add(start(7), timestamp=100.0, now=0.0)
    assert set(log.tracker.in_progress) == {(0, 7)}
    log.add(end(7), timestamp=101.0, now=1.0)
    assert log.tracker.in_progress == {}
    log.at_end()
    assert log.tracker.due(now=60.0) == []


def test_the_deadline_is_the_marker_timestamp_plus_redeliver_after_on_the_markers_clock():
    log = Log()
    log.add(start(1), timestamp=100.0, now=0.0)
    log.at_end()
    assert log.tracker.due(now=9.9) == []
    [due] = log.tracker.due(now=10.0)
    assert due.start.ref == (0, 1) and due.queue == "q" and not due.dead and due.next_deliveries == 2
    assert due.start.payload == b"body 1" and due.start.message_id == "m1"
    assert log.tracker.due(now=11.0) == [], "handed out once"
    assert (0, 1) in log.tracker.in_progress, "stays in progress (and pins the offset) until its End marker"


def test_keep_alives_move_the_deadline():
    log = Log()
    log.add(start(1), timestamp=100.0, now=0.0)
    log.add(keep_alive(1), timestamp=105.0, now=5.0)
    log.add(keep_alive(1), timestamp=112.0, now=12.0)
    log.at_end()
    assert log.tracker.due(now=21.9) == []
    assert [d.start.ref for d in log.tracker.due(now=22.0)] == [(0, 1)]


def test_a_keep_alive_with_a_short_deadline_redelivers_at_once():
    """Retry: a KeepAlive whose deadline is its own timestamp."""
    log = Log()
    log.add(start(1), timestamp=100.0, now=0.0)
    log.add(keep_alive(1, after=0.0), timestamp=101.0, now=1.0)
    log.at_end()
    assert [d.start.ref for d in log.tracker.due(now=1.0)] == [(0, 1)]


def test_a_straggling_keep_alive_neither_revives_an_ended_message_nor_postpones_a_due_one():
    log = Log()
    log.add(start(1), timestamp=100.0, now=0.0)
    log.add(end(1), timestamp=101.0, now=1.0)
    log.add(keep_alive(1), timestamp=102.0, now=2.0)
    assert log.tracker.in_progress == {}
    log.add(start(2), timestamp=103.0, now=3.0)
    log.at_end()
    assert len(log.tracker.due(now=13.0)) == 1
    log.add(keep_alive(2), timestamp=113.5, now=13.5)
    log.at_end()
    assert log.tracker.in_progress[(0, 2)].due, "still handed out, awaiting the tracker's own End marker"
    assert log.tracker.due(now=100.0) == []


def test_markers_hidden_behind_an_open_transaction_stop_the_deadline_clock():
    """read_committed stops at an open transaction (a consumer died inside its Start transaction): the
    KeepAlives written after it are hidden, so the end reached is not the end of the log."""
    log = Log()
    log.add(start(1), timestamp=100.0, now=0.0)
    log.at_end()
    assert log.tracker.caught_up and log.tracker.due(now=5.0) == []
    log.at_end(hidden=3)  # the open transaction's first record, then message 1's keep-alives
    assert not log.tracker.caught_up
    assert log.tracker.logical_now(50.0) == 105.0, "the clock stays where it was"
    assert log.tracker.due(now=50.0) == []
    log.offset += 1  # the broker aborted the transaction: its record is skipped, what it hid is read
    log.add(keep_alive(1), timestamp=108.0, now=60.0)
    log.add(keep_alive(1), timestamp=115.0, now=60.0)
    log.at_end()
    assert log.tracker.due(now=69.9) == [] and len(log.tracker.due(now=70.0)) == 1


def test_the_committed_offset_is_the_oldest_start_still_in_progress():
    log = Log()
    assert log.tracker.commit_offset() is None
    first = log.add(start(1), timestamp=100.0, now=0.0)
    log.add(start(2), timestamp=100.1, now=0.1)
    log.add(keep_alive(1), timestamp=101.0, now=1.0)
    assert log.tracker.commit_offset() == first
    log.add(end(2), timestamp=102.0, now=2.0)
    assert log.tracker.commit_offset() == first, "an End of a later message does not move it"
    log.add(end(1), timestamp=103.0, now=3.0)
    assert log.tracker.commit_offset() == log.offset, "nothing in progress: after the last marker read"


def test_a_restarted_tracker_rebuilds_the_same_state_from_the_committed_offset():
    markers = [(start(1), 100.0), (start(2), 100.5), (end(1), 101.0), (keep_alive(2), 104.0), (start(3), 105.0)]
    whole = Log()
    for marker, timestamp in markers:
        whole.add(marker, timestamp, now=timestamp - 100)
    committed = whole.tracker.commit_offset()
    assert committed == 1, "start(2) at offset 1 is the oldest in progress"

    replayed = PartitionTracker(partition=0)
    for offset, (marker, timestamp) in enumerate(markers[committed:], start=committed):
        replayed.apply("q", marker, offset, timestamp, now=500.0)  # replayed much later, quickly
    assert set(replayed.in_progress) == set(whole.tracker.in_progress) == {(0, 2), (0, 3)}
    assert replayed.in_progress[(0, 2)].deadline == whole.tracker.in_progress[(0, 2)].deadline == 114.0
    assert replayed.commit_offset() == committed


def test_the_clock_does_not_run_on_local_time_while_replaying():
    """Behind the log's end, an End marker may still be unread: only marker timestamps count."""
    log = Log()
    log.add(start(1), timestamp=100.0, now=0.0)
    assert log.tracker.logical_now(1000.0) == 100.0, "not caught up: the clock stays at the last marker"
    log.add(keep_alive(5), timestamp=111.0, now=1000.5)  # a later marker moves the clock past the deadline
    assert log.tracker.logical_now(1000.5) == 111.0
    log.at_end()
    assert [d.start.ref for d in log.tracker.due(now=1000.5)] == [(0, 1)]


def test_a_partition_with_nothing_to_read_is_rebuilt_at_its_end_event():
    """librdkafka's position() stays unknown until a record of the partition is handed out: an empty markers
    partition, or one assigned at its committed end, is read to its end when the end-of-partition event says so
    (it used to show as replaying for ever)."""
    empty = PartitionTracker(0)
    empty.read_to(None, 0)
    assert not empty.rebuilt and not empty.caught_up
    empty.reached_end(0)
    empty.read_to(None, 0)
    assert empty.rebuilt and empty.caught_up
    at_committed_end = PartitionTracker(0)
    at_committed_end.reached_end(7)
    at_committed_end.read_to(None, 9)  # a marker more since: not there yet
    assert not at_committed_end.rebuilt
    at_committed_end.read_to(9, 9)
    assert at_committed_end.rebuilt


def test_nothing_is_handed_out_before_the_partition_is_rebuilt():
    """A deadline passed by the markers read so far proves nothing about an End marker further on: the
    previous owner's, which redelivered the message already (the simulator's seed 1117 did this twice)."""
    log = Log()
    log.add(start(1), timestamp=100.0, now=0.0)
    log.add(keep_alive(5), timestamp=111.0, now=0.5)
    log.tracker.read_to(log.offset, log.offset + 2)  # the high watermark first known after the assignment
    assert log.tracker.due(now=0.5) == [] and not log.tracker.rebuilt, "the End of message 1 may be next"
    log.add(end(1), timestamp=112.0, now=0.6)
    log.add(keep_alive(5), timestamp=113.0, now=0.6)
    log.tracker.read_to(log.offset, log.offset + 50)  # rebuilt, though busier than ever
    assert log.tracker.rebuilt and log.tracker.due(now=0.7) == []


def test_once_rebuilt_a_busy_partition_hands_out_by_the_timestamps_read():
    """Under steady traffic librdkafka keeps fetching ahead: the position trails the high watermark in
    most rounds, and redeliveries must not wait for a quiet one."""
    log = Log()
    log.add(start(1), timestamp=100.0, now=0.0)
    log.at_end()
    for n in range(12):
        log.add(keep_alive(50 + n), timestamp=101.0 + n, now=1.0 + n)
        log.at_end(hidden=5)
    assert not log.tracker.caught_up
    assert [d.start.ref for d in log.tracker.due(now=12.0)] == [(0, 1)]


def test_caught_up_and_quiet_the_clock_runs_on_the_local_monotonic_clock_from_the_last_marker():
    log = Log()
    log.add(start(1), timestamp=100.0, now=50.0)
    log.at_end()
    assert log.tracker.logical_now(55.0) == 105.0
    assert log.tracker.due(now=59.9) == []
    assert len(log.tracker.due(now=60.0)) == 1


def test_the_clock_never_goes_back():
    log = Log()
    log.add(start(1), timestamp=100.0, now=0.0)
    log.at_end()
    assert log.tracker.logical_now(8.0) == 108.0
    log.add(start(2), timestamp=104.0, now=8.5)  # appended earlier than the local clock guessed
    assert log.tracker.logical_now(8.5) == 108.0


def test_no_redelivery_before_any_marker_was_read():
    log = Log()
    log.at_end()
    assert log.tracker.logical_now(1e9) is None and log.tracker.due(1e9) == []


def test_max_deliveries_makes_the_last_delivery_dead():
    log = Log()
    log.add(start(1, deliveries=2, max_deliveries=3), timestamp=100.0, now=0.0)
    log.add(start(2, deliveries=3, max_deliveries=3), timestamp=100.0, now=0.0)
    log.add(start(3, deliveries=9, max_deliveries=None), timestamp=100.0, now=0.0)
    log.at_end()
    due = {d.start.ref[1]: d for d in log.tracker.due(now=10.0)}
    assert not due[1].dead and due[1].next_deliveries == 3
    assert due[2].dead
    assert not due[3].dead and due[3].next_deliveries == 10, "no limit: redelivered for ever"


def test_a_released_message_is_redelivered_at_once_without_counting_a_delivery():
    log = Log()
    log.add(start(1, deliveries=3, max_deliveries=3), timestamp=100.0, now=0.0)
    log.add(Marker(Kind.RELEASE, (0, 1)), timestamp=100.2, now=0.2)
    log.at_end()
    [due] = log.tracker.due(now=0.2)
    assert not due.dead and due.next_deliveries == 3


def test_a_failed_redelivery_is_tried_again_after_the_backoff():
    log = Log()
    log.add(start(1), timestamp=100.0, now=0.0)
    log.at_end()
    [due] = log.tracker.due(now=10.0)
    log.tracker.postpone(due.start.ref, 1.0, now=10.0)
    assert log.tracker.due(now=10.9) == []
    assert len(log.tracker.due(now=11.0)) == 1


def test_a_second_start_for_the_same_record_takes_its_deadline_and_keeps_the_first_offset():
    log = Log()
    first = log.add(start(1), timestamp=100.0, now=0.0)
    log.add(start(1), timestamp=105.0, now=5.0)
    assert log.tracker.commit_offset() == first
    log.at_end()
    assert log.tracker.due(now=14.9) == []
    assert len(log.tracker.due(now=15.0)) == 1


def test_stats_per_queue_count_and_oldest_start():
    log = Log()
    log.add(start(1), timestamp=100.0, now=0.0, queue="a")
    log.add(start(2), timestamp=101.0, now=1.0, queue="a")
    log.add(start(3), timestamp=102.0, now=2.0, queue="b")
    log.add(end(1), timestamp=103.0, now=3.0, queue="a")
    stats = log.tracker.stats()
    assert (stats["a"].in_progress, stats["a"].oldest_started) == (1, 101.0)
    assert (stats["b"].in_progress, stats["b"].oldest_started) == (1, 102.0)


@pytest.mark.parametrize("ends", [0, 1, 500, 999])
def test_many_messages_every_one_due_exactly_once(ends):
    log = Log()
    for n in range(1000):
        log.add(start(n, after=5.0 + n % 7), timestamp=100.0 + n / 1000, now=n / 1000)
    for n in range(ends):
        log.add(end(n), timestamp=101.0, now=1.0)
    log.at_end()
    seen = [d.start.ref[1] for step in range(40) for d in log.tracker.due(now=1.0 + step * 0.5)]
    assert sorted(seen) == list(range(ends, 1000))
