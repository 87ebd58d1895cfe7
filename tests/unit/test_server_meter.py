"""The benchmarks' server meter on a server without pg_stat_statements loaded (a container started without
shared_preload_libraries, say): it reports the rest and says in one line what it cannot measure, instead of failing."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import psycopg

from project.bench.dbcost import ServerMeter


class Server:
    """A session on a server whose checkpointer is this process (so psutil finds a parent), with the extension
    created and, unless `loaded`, not in shared_preload_libraries."""

    def __init__(self, loaded: bool) -> None:
        self.loaded, self.rows = loaded, []

    def cursor(self) -> Any:
        server = self

        class Cursor:
            def __enter__(self) -> Cursor:
                return self

            def __exit__(self, *_: object) -> None:
                return None

            def execute(self, query: str, *_: object) -> None:
                if "checkpointer" in query:
                    server.rows = [(os.getpid(),)]
                elif "pg_extension" in query:
                    server.rows = [(1,)]
                elif "FROM pg_stat_statements" in query and not server.loaded:
                    raise psycopg.errors.ObjectNotInPrerequisiteState(
                        "pg_stat_statements must be loaded via shared_preload_libraries")
                else:
                    server.rows = [(1,)]

            def fetchone(self) -> Any:
                return server.rows[0] if server.rows else None

        return Cursor()

    def transaction(self) -> Any:
        return contextlib.nullcontext()


def test_statements_not_loaded_are_said_not_fatal() -> None:
    meter = ServerMeter(Server(loaded=False))
    assert (meter.has_statements, meter.without_statements) == (
        False, "pg_stat_statements is not loaded (shared_preload_libraries)")
    assert meter.statements().kinds == {}  # read as none, no query sent


def test_statements_loaded_are_read() -> None:
    meter = ServerMeter(Server(loaded=True))
    assert (meter.has_statements, meter.without_statements) == (True, None)
