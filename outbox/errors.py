"""Errors raised to applications that write to the outbox."""

from __future__ import annotations

from django.db import transaction

from outbox.invalid import InvalidRecord

__all__ = ["InvalidRecord", "OutsideTransaction"]


class OutsideTransaction(transaction.TransactionManagementError):
    """stash() was called in autocommit mode, where the record would not be atomic with anything."""
