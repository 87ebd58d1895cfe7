"""Measurement hooks the engine calls; the default does nothing. outbox.metrics implements them for Prometheus."""

from __future__ import annotations


class Instruments:
    """Override what you want to measure. Called on the marker and delivery threads: keep them cheap."""

    def marked(self, seconds: float, rows: int) -> None:
        """A mark query returned `rows` rows after `seconds`."""

    def purged(self, seconds: float, rows: int) -> None:
        """A purge of `rows` delivered rows committed after `seconds`."""

    def reset(self, rows: int) -> None:
        """`rows` rows were reset after failed deliveries."""

    def database(self, kind: str, seconds: float, rows: int) -> None:
        """A database job of `kind` (dbtime.ROUND_TRIP_KINDS) answered `rows` rows after a round trip of `seconds`
        (on the fence or the purge session's thread; a failed one answers 0 rows)."""
