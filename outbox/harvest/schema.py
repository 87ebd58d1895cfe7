"""What the harvester uses in the database besides the outbox table's rows, for a database no Django project
migrates: schema.sql holds the DDL of the outbox app's migrations, one section per migration, as
`manage.py sqlmigrate` prints it (a test holds the two identical). `outbox-harvest schema` prints it and
`--apply` runs it, every section in one transaction: a failure changes nothing.

Nothing records which sections ran (Django's migration table is Django's): a database that has the replica
status table has the schema, and an upgrade runs the sections after the one it was made with (`since`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psycopg

from outbox.harvest.store import STATUS_TABLE, StoreError, describe_dsn
from outbox.kafka.redaction import dsn_problem
from outbox.reasons import first_line

SQL = Path(__file__).with_suffix(".sql")
MARK = "-- migration: "


@dataclass(frozen=True)
class Section:
    """One migration's DDL."""

    name: str
    sql: str


def header() -> str:
    return SQL.read_text().split(MARK, 1)[0]


def sections() -> list[Section]:
    """Every migration's DDL, oldest first."""
    found = []
    for chunk in SQL.read_text().split(MARK)[1:]:
        name, _, body = chunk.partition("\n")
        found.append(Section(name.strip(), body.strip() + "\n"))
    return found


def after(since: str | None) -> list[Section]:
    """The sections after the migration named `since` (all of them for None); ValueError naming the known ones."""
    every = sections()
    if since is None:
        return every
    names = [s.name for s in every]
    matches = [i for i, name in enumerate(names) if name == since or name.split("_", 1)[0] == since]
    if not matches:
        raise ValueError(f"--since: no migration {since!r} (there are {', '.join(names)})")
    return every[matches[0] + 1:]


def ddl(since: str | None = None) -> str:
    """The DDL to print: the header, then each section after `since` with its name."""
    return header() + "".join(f"\n{MARK}{s.name}\n{s.sql}" for s in after(since))


def statements(section: Section) -> str:
    """A section's statements without its own BEGIN and COMMIT (apply() runs them all in one transaction)."""
    return "\n".join(line for line in section.sql.splitlines() if line.strip() not in {"BEGIN;", "COMMIT;"})


def apply(dsn: str, since: str | None = None) -> list[str]:
    """Run the sections after `since` (all for None) on the database at `dsn`, in one transaction: all of them
    or, on an error, none (StoreError, one line). Without `since`, a database that has the replica status table
    (the schema) or an outbox table (goharvest's own) is refused before anything runs."""
    where = describe_dsn(dsn)
    pending = after(since)
    try:
        conn = psycopg.connect(dsn, autocommit=True, connect_timeout=10)
    except psycopg.ProgrammingError:  # libpq cannot parse it; its words could quote part of a password
        raise StoreError(f"cannot connect to Postgres: dsn {dsn_problem(dsn)}") from None
    except psycopg.Error as error:
        raise StoreError(f"cannot connect to Postgres at {where}: {first_line(error)}") from None
    with conn:
        try:
            made, outbox = conn.execute("SELECT to_regclass(%s), to_regclass('outbox')", (STATUS_TABLE,)).fetchone()
        except psycopg.Error as error:
            raise StoreError(f"cannot read the schema at {where}: {first_line(error)}") from None
        if since is None and made is not None:
            raise StoreError(f"{where} already has table {STATUS_TABLE}: its schema was made before (by manage.py "
                             f"migrate or an earlier --apply); to upgrade, apply the migrations after the one it was "
                             f"made with: --since MIGRATION (the newest is {sections()[-1].name})")
        if since is None and outbox is not None:
            raise StoreError(f"{where} already has table outbox (goharvest's?): to add the rest to it, apply the "
                             f"migrations after the one that makes it: --since {sections()[0].name}")
        try:
            with conn.transaction():
                for section in pending:
                    conn.execute(statements(section).encode())  # several statements: psycopg sends them as a script
        except psycopg.Error as error:
            raise StoreError(f"the schema was not applied (nothing was changed): {first_line(error)}") from None
    return [section.name for section in pending]
