"""Errors raised to applications that write to the outbox."""

from __future__ import annotations

from django.db import transaction


class InvalidRecord(ValueError):
    """A record stash() refused before running any SQL; names the field and the limit it broke."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class OutsideTransaction(transaction.TransactionManagementError):
    """stash() was called in autocommit mode, where the record would not be atomic with anything."""
