"""The queue's public functions, configured from OUTBOX["queues"]: send, stash, consumer.

send() publishes at once through a process-wide idempotent producer; stash() writes the message
into the outbox in the caller's transaction, so it is published by `manage.py harvest` if and
only if the transaction commits. Both accept what the outbox's stash() accepts as a value (str,
UTF-8 bytes, a dict or list sent as JSON) and headers as (str, str) pairs or a mapping, and
return the message id the consumer sees as `message.id`.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from outbox import conf as outbox_conf
from outbox.errors import InvalidRecord
from outbox.kafka.clients import KafkaUnavailable
from outbox.queue import app_settings, markers, metrics
from outbox.queue.config import QUEUE_NAME_PATTERN, QueueConfig, QueueLimits, queue_name_problem
from outbox.queue.errors import QueueError
from outbox.queue.instruments import QueueInstruments
from outbox.queue.markers_consumer import QueueConsumer
from outbox.queue.producer import MessageTooLarge, QueueProducer
from outbox.queue.share_consumer import ShareQueueConsumer
from outbox.queue.share_group import ensure_share_topic
from outbox.queue.topics import ensure_topics, topic_limit
from outbox.queue.tracing import consumer_tracer
from outbox.stasher import stash as outbox_stash
from outbox.stasher import stash_many as outbox_stash_many
from outbox.tracing.propagation import add_headers, current_headers
from outbox.tracing.switch import tracing_on
from outbox.validation import clean

Headers = Mapping[str, str] | Iterable[tuple[str, str]] | None

_producers: dict[tuple[int, str], QueueProducer] = {}
_producers_lock = threading.Lock()


def send(queue: str, payload: Any, *, headers: Headers = None) -> str:
    """Publish one message to `queue` now; blocks until Kafka acknowledged it. Returns its id."""
    return send_many(queue, [payload], headers=headers)[0]


def send_many(queue: str, payloads: Iterable[Any], *, headers: Headers = None) -> list[str]:
    """Publish many messages to `queue` (the same headers on each); returns their ids in order.

    All are validated before any is sent; QueueError if Kafka did not acknowledge every one (some
    may have been published: at-least-once, so retrying may duplicate them).
    """
    config = app_settings.queue_config()
    validate_queue(queue)
    payloads, headers = list(payloads), _reusable(headers)
    rows = [_clean(config, payload, headers, _where(index, payloads)) for index, payload in enumerate(payloads)]
    context = current_headers() if tracing_on() else None
    if context:
        for row in rows:
            add_headers(row, context)
    messages = [(row.value.encode(), list(zip(row.header_keys, map(str.encode, row.header_values), strict=True)))
                for row in rows]
    if not messages:
        return []
    _ensure_share_topic(config, queue)
    return _producer(config).send(queue, messages)


def stash(queue: str, payload: Any, *, headers: Headers = None, using: str | None = None) -> str:
    """Write one message for `queue` into the outbox, inside the caller's transaction; returns its id.

    outbox.OutsideTransaction outside transaction.atomic(), as the outbox's stash().
    """
    return stash_many(queue, [payload], headers=headers, using=using)[0]


def stash_many(queue: str, payloads: Iterable[Any], *, headers: Headers = None,
               using: str | None = None) -> list[str]:
    """Write many messages for `queue` into the outbox in one statement per 1,000; returns their ids."""
    config = app_settings.queue_config()
    validate_queue(queue)
    payloads, headers = list(payloads), _reusable(headers)
    _ensure_share_topic(config, queue)  # with its partitions, before the harvester's producer would auto-create it
    topic = config.topic_for(queue)
    records = []
    ids = []
    for index, payload in enumerate(payloads):
        row = _clean(config, payload, headers, _where(index, payloads))
        message_id = uuid.uuid4().hex
        ids.append(message_id)
        # "queue/id" keys: the harvester keeps one record per key in flight and hashes the key to a
        # partition, so a key per message spreads a queue's messages and never holds one back.
        records.append({"topic": topic, "key": f"{queue}/{message_id}", "value": row.value,
                        "headers": [*zip(row.header_keys, row.header_values, strict=True),
                                    (markers.ID_HEADER, message_id)]})
    if len(records) == 1:
        outbox_stash(**records[0], using=using)
    elif records:
        outbox_stash_many(records, using=using)
    return ids


def consumer(queue: str, *, name: str | None = None, redelivery_timeout: float | None = None,
             keep_alive_interval: float | None = None, max_in_progress: int | None = None,
             max_deliveries: int | None = None,
             instruments: QueueInstruments | None = None) -> QueueConsumer | ShareQueueConsumer:
    """A started consumer of `queue`; close() it (or use it as a context manager) when done.

    Limits and the backend default to OUTBOX["queues"] (and its per_queue entry for `queue`); arguments win.
    QueueError with a one-line reason when Kafka cannot be reached or the settings are invalid.
    """
    config = app_settings.queue_config()
    validate_queue(queue)
    limits = limits_for(config, queue, redelivery_timeout=redelivery_timeout,
                        keep_alive_interval=keep_alive_interval, max_in_progress=max_in_progress,
                        max_deliveries=max_deliveries)
    return new_consumer(config, queue, limits=limits, name=name,
                        instruments=instruments or metrics.default_instruments()).start()


def new_consumer(config: QueueConfig, queue: str, *, limits: QueueLimits, name: str | None,
                 instruments: QueueInstruments) -> QueueConsumer | ShareQueueConsumer:
    """A consumer of `queue` on its backend (not started): the markers protocol, or Kafka's share groups."""
    if limits.backend == "share":
        from outbox.queue import store

        return ShareQueueConsumer(config, queue, limits=limits, name=name, instruments=instruments,
                                  dead_letters=store.store_share_dead_letters,
                                  tracer=consumer_tracer(config, queue, share=True))
    return QueueConsumer(config, queue, limits=limits, name=name, instruments=instruments,
                         tracer=consumer_tracer(config, queue))


def _ensure_share_topic(config: QueueConfig, queue: str) -> None:
    if config.backend(queue) != "share":
        return
    try:
        ensure_share_topic(config, queue, 10.0)
    except KafkaUnavailable as error:
        raise QueueError(str(error)) from None


def requeue(letter: Any) -> None:
    """Send a dead letter (outbox.queue.models.DeadLetter) back to its queue: same id and key, deliveries from 1."""
    config = app_settings.queue_config()
    headers = [(str(name), str(value).encode()) for name, value in letter.headers]
    _ensure_share_topic(config, letter.queue)  # to the queue's backend now, whichever wrote the letter
    try:
        _producer(config).send(letter.queue, [(bytes(letter.payload or b""), headers)],
                               key=bytes(letter.key) if letter.key else None, ids=[letter.message_id])
    except MessageTooLarge as error:  # its topics' limit was lowered since it was first sent
        raise QueueError(f"dead letter {letter.message_id}: {error}") from None


def limits_for(config: QueueConfig, queue: str, **overrides: Any) -> QueueLimits:
    """The queue's limits from settings with `overrides` (None: keep); a new timeout re-derives the keep-alive."""
    limits = config.limits_for(queue)
    changes = {k: v for k, v in overrides.items() if v is not None}
    if "redelivery_timeout" in changes and "keep_alive_interval" not in changes:
        derived = QueueLimits(redelivery_timeout=limits.redelivery_timeout).keep_alive_interval
        if limits.keep_alive_interval == derived:  # not set by hand: derive it from the new timeout
            changes["keep_alive_interval"] = None
    return dataclasses.replace(limits, **changes) if changes else limits


def validate_queue(queue: Any) -> None:
    """InvalidRecord unless `queue` is a valid queue name."""
    if not isinstance(queue, str) or not QUEUE_NAME_PATTERN.fullmatch(queue):
        raise InvalidRecord("queue", queue_name_problem(queue))


def _reusable(headers: Headers) -> Headers:
    """Headers given as an iterator are read once per message: keep them in a list."""
    if isinstance(headers, Iterable) and not isinstance(headers, Mapping | str | bytes | list | tuple):
        return list(headers)
    return headers


def _where(index: int, payloads: Sequence[Any]) -> str:
    return "payload" if len(payloads) == 1 else f"payloads[{index}]"


def _clean(config: QueueConfig, payload: Any, headers: Headers, where: str) -> Any:
    """The outbox's own validation (so send() and stash() accept the same), with the queue's field names."""
    if payload is None:
        raise InvalidRecord(where, "must not be None (a queue message has a body)")
    if isinstance(headers, Iterable) and not isinstance(headers, str | bytes):
        pairs = headers.items() if isinstance(headers, Mapping) else headers
        for position, pair in enumerate(pairs):
            name = pair[0] if isinstance(pair, tuple | list) and pair else None
            if isinstance(name, str) and name.startswith(markers.RESERVED_PREFIX):
                raise InvalidRecord(f"headers[{position}]", f"name {name!r} is reserved: the queue's own headers "
                                                            f"start with {markers.RESERVED_PREFIX!r}")
    try:
        return clean(config.topic, "-", payload, headers, max_value_bytes=outbox_conf.setting("max_value_bytes"),
                     max_header_bytes=outbox_conf.setting("max_header_bytes"))
    except InvalidRecord as error:
        field = where if error.field == "value" else error.field
        raise InvalidRecord(field, str(error)[len(error.field) + 2:]) from None


def _producer(config: QueueConfig) -> QueueProducer:
    """One producer per process and broker settings; a forked child (a pre-forking server) makes its own."""
    key = (os.getpid(), repr(sorted((k, repr(v)) for k, v in config.base_kafka_config.items())) + config.topic)
    producer = _producers.get(key)
    if producer is not None:
        return producer
    with _producers_lock:
        producer = _producers.get(key)
        if producer is None:
            try:
                limit = ensure_topics(config, 10.0)
            except Exception as error:
                raise QueueError(str(error)) from None
            producer = _producers[key] = QueueProducer(config, instruments=metrics.default_instruments(), limit=limit,
                                                       read_limit=lambda: topic_limit(config, 5.0))
    return producer
