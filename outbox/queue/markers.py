"""The wire format: queue records and the Start / KeepAlive / End / Release markers that track them.

A queue record is keyed by its queue's name (or "name/message-id" when it went through the
outbox, so the harvester spreads such records over partitions and never holds one back for
another) and carries its message id and delivery count in headers:

    mq-id           the message id, the same on every delivery (the inbox keys on it)
    mq-deliveries   1 on the first delivery, n + 1 on the n-th redelivery

A marker is keyed by the queue's name, so all markers of a queue land on one partition of the
markers topic, in the order the consumer sent them. kafka-mq-go encodes markers in protobuf; here
the marker's fields are headers and a Start marker's value is the message's payload as is, so a
marker costs no serialisation of the payload and stays readable with Kafka's console tools:

    mq-marker              start | keepalive | end | release
    mq-ref                 "partition:offset" of the record in the queue topic
    mq-redeliver-after-ms  start and keepalive: the deadline is the marker's timestamp plus this
    mq-max-deliveries      start: dead-letter instead of a delivery beyond this (absent: no limit)
    mq-key                 start: the record's key
    (the record's own headers, mq-id and mq-deliveries among them: start only)

A release marker hands back a message the consumer never gave its application (on close):
the tracker redelivers it at once without counting a delivery.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ID_HEADER = "mq-id"
DELIVERIES_HEADER = "mq-deliveries"
MARKER_HEADER = "mq-marker"
REF_HEADER = "mq-ref"
REDELIVER_AFTER_HEADER = "mq-redeliver-after-ms"
MAX_DELIVERIES_HEADER = "mq-max-deliveries"
KEY_HEADER = "mq-key"
#: Tracing on: the traceparents of a message's earlier deliveries' spans, comma-separated; kept by the
#: Start marker and redeliveries so the next delivery's span links to them (outbox/tracing/consume.py).
TRACE_LINKS_HEADER = "mq-trace-links"
#: ... the newest this many.
MAX_TRACE_LINKS = 16
#: Header names reserved for the queue: applications may not set headers starting with this.
RESERVED_PREFIX = "mq-"
_MARKER_ONLY = frozenset({MARKER_HEADER, REF_HEADER, REDELIVER_AFTER_HEADER, MAX_DELIVERIES_HEADER, KEY_HEADER})

#: A record's place in the queue topic: (partition, offset). Identifies one delivery of a message.
Ref = tuple[int, int]
Headers = Sequence[tuple[str, bytes | None]]


class MarkerError(ValueError):
    """A record on the markers topic that is not a marker of this format."""


class Kind(enum.Enum):
    START = "start"
    KEEPALIVE = "keepalive"
    END = "end"
    RELEASE = "release"


_KINDS = {kind.value.encode(): kind for kind in Kind}


@dataclass(frozen=True, slots=True)
class Marker:
    kind: Kind
    ref: Ref
    #: Start and KeepAlive: seconds from the marker's timestamp to the redelivery deadline.
    redeliver_after: float = 0.0
    #: Start only: what a redelivery needs, with no seek into the queue topic (kafka-mq-go's point 3).
    key: bytes | None = None
    payload: bytes | None = None
    headers: tuple[tuple[str, bytes], ...] = ()
    max_deliveries: int | None = None

    @property
    def message_id(self) -> str:
        return header_text(self.headers, ID_HEADER) or ref_id(self.ref)

    @property
    def deliveries(self) -> int:
        return deliveries_of(self.headers)


def ref_id(ref: Ref) -> str:
    """The id of a record that came without one (written to the queue topic by another tool)."""
    return f"p{ref[0]}o{ref[1]}"


def header_text(headers: Iterable[tuple[str, bytes | None]] | None, name: str) -> str | None:
    for key, value in headers or ():
        if key == name and value is not None:
            return value.decode("utf-8", "replace")
    return None


def trace_links(headers: Iterable[tuple[str, bytes | None]] | None) -> list[str]:
    """The traceparents of a message's earlier deliveries' spans (TRACE_LINKS_HEADER), oldest first."""
    text = header_text(headers, TRACE_LINKS_HEADER)
    return [part for part in text.split(",") if part] if text else []


def deliveries_of(headers: Iterable[tuple[str, bytes | None]] | None) -> int:
    text = header_text(headers, DELIVERIES_HEADER)
    try:
        return max(1, int(text)) if text else 1
    except ValueError:
        return 1


def message_headers(headers: Iterable[tuple[str, bytes | None]] | None, *, message_id: str,
                    deliveries: int) -> list[tuple[str, bytes]]:
    """A queue record's headers: the application's own, then the id and the delivery count."""
    kept = [(k, v or b"") for k, v in headers or () if not k.startswith(RESERVED_PREFIX) or k == TRACE_LINKS_HEADER]
    kept.append((ID_HEADER, message_id.encode()))
    if deliveries > 1:
        kept.append((DELIVERIES_HEADER, str(deliveries).encode()))
    return kept


def encode(marker: Marker) -> tuple[bytes | None, list[tuple[str, bytes]]]:
    """The value and headers of the record that carries `marker`."""
    headers = [(MARKER_HEADER, marker.kind.value.encode()), (REF_HEADER, f"{marker.ref[0]}:{marker.ref[1]}".encode())]
    if marker.kind in (Kind.START, Kind.KEEPALIVE):
        headers.append((REDELIVER_AFTER_HEADER, str(round(marker.redeliver_after * 1000)).encode()))
    if marker.kind is not Kind.START:
        return None, headers
    if marker.max_deliveries is not None:
        headers.append((MAX_DELIVERIES_HEADER, str(marker.max_deliveries).encode()))
    if marker.key is not None:
        headers.append((KEY_HEADER, marker.key))
    headers.extend(marker.headers)
    return marker.payload, headers


def decode(value: bytes | None, headers: Headers | None) -> Marker:
    """The marker carried by a record of the markers topic; MarkerError if it is not one."""
    fields: dict[str, bytes] = {}
    own: list[tuple[str, bytes]] = []
    for name, raw in headers or ():
        if name in _MARKER_ONLY:
            fields[name] = raw or b""
        else:
            own.append((name, raw or b""))
    kind = _KINDS.get(fields.get(MARKER_HEADER, b""))
    if kind is None:
        raise MarkerError(f"not a marker: {MARKER_HEADER} is {fields.get(MARKER_HEADER)!r}")
    try:
        partition, offset = fields[REF_HEADER].split(b":")
        ref = (int(partition), int(offset))
        after = int(fields[REDELIVER_AFTER_HEADER]) / 1000 if kind in (Kind.START, Kind.KEEPALIVE) else 0.0
        limit = fields.get(MAX_DELIVERIES_HEADER)
        max_deliveries = int(limit) if limit else None
    except (KeyError, ValueError) as error:
        raise MarkerError(f"malformed {kind.value} marker: {error!r}") from None
    if kind is not Kind.START:
        return Marker(kind, ref, after)
    return Marker(kind, ref, after, key=fields.get(KEY_HEADER), payload=value, headers=tuple(own),
                  max_deliveries=max_deliveries)
