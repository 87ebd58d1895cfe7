"""The engine's record producer, and those it replaced that still owe delivery reports.

A producer is replaced in two cases. After a fatal error (`restart`) what it holds is purged, so it fails now, and
it is served until it has reported every record: only then is the core told (Core.on_producer_restarted), and
only then may a key's next record go out. For a smaller batch limit (`fit`: a topic's max.message.bytes is below
what the producer's batches may reach) it is rebuilt only once it has nothing left to report, so no record of a
key can overtake one still in the old producer.

The threaded runtime's delivery thread (runtime.DeliveryPoller) serves the replaced producers with `serve_retiring`,
and the simulator runs the same step on its clock (tests/sim/engine.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from confluent_kafka import KafkaException

from outbox.harvest.kafka import ProducerLike
from outbox.kafka.sizes import batch_size_for

log = logging.getLogger("outbox.harvest")


class RecordProducers:
    """The record producer in use (`current`), the replaced ones still reporting, and the batch limit it fits.

    `build(limit)` makes a producer whose batches fit `limit` bytes (None: as configured)."""

    def __init__(self, build: Callable[[int | None], ProducerLike], batch_limit: int,
                 on_retired: Callable[[], None]) -> None:
        self._build = build
        #: The producer's batches fit a topic whose max.message.bytes is at least this (topics.UNLIMITED: any).
        self.batch_limit = batch_limit
        self._built_for: int | None = None  # as configured, until fit() lowers it
        self.current = build(None)
        self._retiring: list[ProducerLike] = []
        self._on_retired = on_retired
        self._lock = threading.Lock()

    @property
    def retiring(self) -> list[ProducerLike]:
        """The producers replaced after a fatal error that have not reported everything yet."""
        with self._lock:
            return list(self._retiring)

    def restart(self) -> None:
        """Replace the producer after a fatal error: what it holds fails now; it is served until it has reported."""
        old = self.current
        try:
            old.purge(in_queue=True, in_flight=True, blocking=False)
        except (KafkaException, NotImplementedError):
            pass
        new = self._build(self._built_for)
        with self._lock:
            self._retiring.append(old)
            self.current = new

    def fit(self, limit: int) -> bool:
        """Rebuild the producer so its batches fit `limit`, once it has nothing left to report; False until then."""
        if limit >= self.batch_limit:
            return True
        if len(self.current) or self.retiring:
            return False
        old = self.current
        self._built_for = self.batch_limit = limit
        new = self._build(limit)
        with self._lock:
            self.current = new
        old.flush(0)
        log.info("Record producer rebuilt with batches of at most %s bytes: the smallest max.message.bytes of "
                 "the topics it sends to is %s bytes", f"{batch_size_for(limit):,}", f"{limit:,}")
        return True

    def serve_retiring(self, poll: Callable[[ProducerLike, float], None]) -> None:
        """One turn of the delivery thread for the replaced producers: their reports out (`poll`); each that has
        nothing left is let go, and the core told."""
        for old in self.retiring:
            poll(old, 0)
            if len(old) == 0:
                old.flush(0)
                with self._lock:
                    self._retiring.remove(old)
                self._on_retired()
