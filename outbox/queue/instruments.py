"""Measurement hooks the queue's clients call; the default does nothing. outbox.queue.metrics implements them."""

from __future__ import annotations


class QueueInstruments:
    """Override what you want to measure. Called on client threads: keep them cheap."""

    def sent(self, queue: str, count: int) -> None:
        """`count` messages were acknowledged by Kafka on the queue topic."""

    def received(self, queue: str) -> None:
        """A consumer handed a message to the application."""

    def acked(self, queue: str, seconds: float) -> None:
        """A message was acknowledged `seconds` after it was received."""

    def retried(self, queue: str) -> None:
        """A message was handed back for redelivery (Retry)."""

    def abandoned(self, queue: str) -> None:
        """A message's processing failed: no ack, redelivered after the timeout."""

    def redelivered(self, queue: str, count: int) -> None:
        """A tracker redelivered `count` messages."""

    def dead_lettered(self, queue: str, count: int) -> None:
        """A tracker moved `count` messages to the dead letters."""
