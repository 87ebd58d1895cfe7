"""Acknowledgements that are not deliveries: Kafka's answer to a batch it takes for a duplicate.

An idempotent producer numbers each partition's records; the broker writes a batch once and answers a
batch whose numbers it has already written with the offsets it wrote them at (or, for older ones,
DUPLICATE_SEQUENCE_NUMBER), and librdkafka reports either as delivered. That is right for a retry of
the same records. If the producer ever numbered other records with numbers already used (its state of
a partition lost and started again), those records were not written, and their reports say delivered
all the same: purging their rows would lose them, with nothing logged.

A record written now lands after everything written before it, at an offset no other record has. So a
report of delivery at an offset this producer was already acknowledged at, or at none, is taken as a
failed delivery: the row stays, the term re-marks, and the record goes out again (a duplicate if it was
written after all). One AckOffsets per producer instance (a new producer is a new idempotent session);
each remembers the last WINDOW to 2 x WINDOW offsets acknowledged per partition.

    acks = AckOffsets()
    acks.repeated(message)   # None, or why the report is not a delivery
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from typing import Any

#: Offsets remembered per partition. Kafka answers a duplicate with its offsets only for one of the
#: producer's last five batches in the partition: 4,096 to 8,192 offsets cover five batches of the usual
#: sizes under load (not five of librdkafka's largest, 10,000 records each).
WINDOW = 4096


class AckOffsets:
    """The offsets one producer's reports of delivery named lately, per partition. Used from the thread
    that serves that producer's reports: they come one at a time, and a partition's in offset order (the
    producer's batches land in order), so each partition's offsets are kept as a sorted array and a new
    one is just appended. It runs for every record: about 0.45 µs a report (docs/benchmarks.md)."""

    def __init__(self, window: int = WINDOW) -> None:
        self._window = window
        #: (topic, partition) -> the offsets acknowledged there lately, ascending.
        self._seen: dict[tuple[str, int], array[int]] = {}

    def repeated(self, message: Any) -> str | None:
        """Why this report of delivery (a confluent_kafka.Message) is not one, or None if it is."""
        offset = message.offset()
        where = (message.topic(), message.partition())
        if offset is None or offset < 0:
            return (f"Kafka reported it delivered to {where[0]} [{where[1]}] at no offset (a duplicate of records "
                    f"this producer sent before, so perhaps never written); sending it again")
        seen = self._seen.get(where)
        if seen is None:
            seen = self._seen[where] = array("q")
        if not seen or offset > seen[-1]:
            seen.append(offset)  # the usual case: the partition's next record
            if len(seen) > 2 * self._window:
                del seen[:self._window]
            return None
        at = bisect_left(seen, offset)
        if at < len(seen) and seen[at] == offset:
            return (f"Kafka reported it delivered to {where[0]} [{where[1]}] at offset {offset}, where another "
                    f"record of this producer was written: it took it for a duplicate and did not write it; "
                    f"sending it again")
        if seen[-1] - offset > self._window:
            del seen[:]  # far below the last: the partition's log began again (the topic was re-created)
            at = 0
        seen.insert(at, offset)  # a report that came out of order (a batch answered late): remembered all the same
        return None
