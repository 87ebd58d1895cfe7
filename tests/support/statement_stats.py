"""pg_stat_statements in the test database, for the tests of what harvesting costs the database."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

#: bin/services' cluster: its superuser and password (initdb --pwfile), which may create the extension.
SUPERUSER = ("postgres", "postgres")


@pytest.fixture
def statement_stats(database_url: str) -> str:
    """pg_stat_statements readable in the test database: the view made here (by the test's role where it may,
    else by bin/services' superuser); skipped where the server does not load the module."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        if conn.execute("SELECT to_regclass('pg_stat_statements')").fetchone()[0] is None:
            try:
                conn.execute("CREATE EXTENSION pg_stat_statements")
            except psycopg.errors.InsufficientPrivilege:
                parts = urlsplit(database_url)
                admin = urlunsplit(parts._replace(
                    netloc=f"{SUPERUSER[0]}:{SUPERUSER[1]}@{parts.hostname}:{parts.port or 5432}"))
                try:
                    with psycopg.connect(admin, autocommit=True) as superuser:
                        superuser.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                except psycopg.Error as error:
                    pytest.fail(f"cannot create pg_stat_statements in the test database as {SUPERUSER[0]}: {error}")
        try:
            conn.execute("SELECT 1 FROM pg_stat_statements LIMIT 1")
        except psycopg.errors.ObjectNotInPrerequisiteState:
            pytest.skip("this Postgres does not load pg_stat_statements (bin/services' cluster does)")
    return database_url
