"""Sizes as a broker measures them against a topic's `max.message.bytes`: a record alone, a producer's batches.

Kafka's record format v2 (KIP-98): a batch header of 61 bytes, then per record its length, attributes,
timestamp and offset deltas, key, value and headers, lengths as zigzag varints. They are uncompressed sizes:
with compression a record may fit that these hold back, as librdkafka's own `message.max.bytes` check at
produce() does. The harvester (harvest/topics.py) and the queues' producer (queue/producer.py) use them.
"""

from __future__ import annotations

from collections.abc import Iterable

#: A topic whose limit could not be learned: the broker judges each batch, as without this module.
UNLIMITED = 2**31 - 1
#: The record batch header (offset, length, epoch, magic, CRC, attributes, deltas, timestamps, producer
#: id and epoch, base sequence, record count).
RECORD_BATCH_OVERHEAD = 61
#: batch.size is kept this far below a topic's limit (up to half of it): librdkafka counts a batch's
#: framing a little differently from the broker, and a compression codec adds a few bytes of its own.
BATCH_HEADROOM = 512
def varint_size(value: int) -> int:
    """Bytes of a zigzag varint (Kafka's record format v2)."""
    zigzag = (value << 1) ^ (value >> 63)
    size = 1
    while zigzag >= 0x80:
        zigzag >>= 7
        size += 1
    return size


def _length(item: str | bytes | None) -> int:
    if item is None:
        return -1
    return len(item.encode() if isinstance(item, str) else item)


def record_size(key: str | bytes | None, value: str | bytes | None,
                headers: Iterable[tuple[str, str | bytes | None]] = ()) -> int:
    """The size of a record batch holding this record alone, as the broker measures it against the
    topic's max.message.bytes (uncompressed)."""
    key_length, value_length = _length(key), _length(value)
    body = 1 + 1 + 1  # attributes, timestamp delta 0, offset delta 0
    body += varint_size(key_length) + max(key_length, 0) + varint_size(value_length) + max(value_length, 0)
    count = 0
    for name, item in headers:
        count += 1
        name_length, item_length = _length(name), _length(item)
        body += varint_size(name_length) + name_length + varint_size(item_length) + max(item_length, 0)
    body += varint_size(count)
    return RECORD_BATCH_OVERHEAD + varint_size(body) + body


def fits(key: str | bytes | None, value: str | bytes | None, headers: list[tuple[str, str | bytes | None]],
         limit: int) -> bool:
    """Whether the record fits `limit` alone; an upper bound first (4 bytes a character, 5 a length,
    no encoding), as nearly every record is far below any limit."""
    bound = RECORD_BATCH_OVERHEAD + 23 + 4 * (len(key or "") + len(value or ""))
    for name, item in headers:
        bound += 10 + 4 * (len(name) + len(item or ""))
    return bound <= limit or record_size(key, value, headers) <= limit


def batch_size_for(limit: int) -> int:
    """librdkafka's batch.size for a producer whose batches must fit `limit` bytes."""
    return max(1, limit - min(BATCH_HEADROOM, limit // 2))


def limit_fitted_by(batch_size: int) -> int:
    """The smallest max.message.bytes that batches of librdkafka's `batch_size` fit (batch_size_for's inverse)."""
    return batch_size + BATCH_HEADROOM


def too_large(size: int, limit: int, topic: str) -> str:
    """The held record's reason, naming the limit."""
    return (f"too large: {size:,} bytes as a message, over topic {topic}'s max.message.bytes of {limit:,} (not "
            f"produced; raise the topic's max.message.bytes, or fix or park the record)")


def bytes_text(value: int) -> str:
    return "unknown" if value == UNLIMITED else f"{value:,}"
