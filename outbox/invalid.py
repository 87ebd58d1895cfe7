"""InvalidRecord, in a module of its own so Django-free code (the queue's producer) can raise it."""

from __future__ import annotations


class InvalidRecord(ValueError):
    """A record stash() refused before running any SQL; names the field and the limit it broke."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")
