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
