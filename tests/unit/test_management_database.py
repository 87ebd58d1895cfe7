"""The maintenance commands' connection: an unreachable database is one line naming it, password masked."""

from __future__ import annotations

import socket

import pytest
from django.core.management.base import CommandError

from outbox.management.database import connect_or_fail


def test_an_unreachable_database_is_one_line_naming_it_without_its_password():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(CommandError) as raised:
        connect_or_fail(f"host=127.0.0.1 port={port} dbname=shop user=app password=hunter2-secret")
    message = str(raised.value)
    assert message.startswith("cannot connect to Postgres at ") and f"{port}" in message, message
    assert "hunter2-secret" not in message and "\n" not in message
