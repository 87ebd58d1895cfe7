"""The maintenance commands' own connection (outbox_partition): autocommit, a short
connect timeout, and an unreachable database said in one line, not a traceback."""

from __future__ import annotations

import psycopg
from django.core.management.base import CommandError

from outbox.harvest.store import describe_dsn
from outbox.reasons import first_line

CONNECT_TIMEOUT = 5


def connect_or_fail(dsn: str) -> psycopg.Connection:
    """An autocommit connection to `dsn`; CommandError naming the server (password masked) if none."""
    try:
        return psycopg.connect(dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT)
    except psycopg.OperationalError as error:
        raise CommandError(f"cannot connect to Postgres at {describe_dsn(dsn)}: {first_line(error)}") from None
