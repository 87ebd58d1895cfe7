"""What the harvester uses in the database besides the outbox table's rows, for a database no Django project
migrates: schema.sql holds the DDL of the outbox app's migrations, one section per migration, as
`manage.py sqlmigrate` prints it (a test holds the two identical). `outbox-harvest schema` prints it and
`--apply` runs it; each section in its own transaction, as `migrate` runs each migration.

Nothing records which sections ran (Django's migration table is Django's): a database that has the replica
status table has the schema, and an upgrade runs the sections after the one it was made with (`since`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psycopg

from outbox.harvest.store import StoreError, describe_dsn
from outbox.reasons import first_line

SQL = Path(__file__).with_suffix(".sql")
MARK = "-- migration: "
#: The table whose presence says the schema was applied (the first migration's other table is the outbox).
STATUS_TABLE = "outbox_harvester"


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


def apply(dsn: str, since: str | None = None) -> list[str]:
    """Run the sections after `since` (all for None) on the database at `dsn`; the names run. Refuses a
    database that already has the schema when `since` is None (StoreError, one line): nothing is half-run
    but a section that failed, which its own transaction undoes."""
    where = describe_dsn(dsn)
    try:
        conn = psycopg.connect(dsn, autocommit=True, connect_timeout=10)
    except psycopg.Error as error:
        raise StoreError(f"cannot connect to Postgres at {where}: {first_line(error)}") from None
    ran: list[str] = []
    with conn:  # closing it rolls back a section that failed half-way
        try:
            made = conn.execute("SELECT to_regclass(%s)", (STATUS_TABLE,)).fetchone()[0] is not None
        except psycopg.Error as error:
            raise StoreError(f"cannot read the schema at {where}: {first_line(error)}") from None
        if since is None and made:
            last = sections()[-1].name
            raise StoreError(f"{where} already has table {STATUS_TABLE}: its schema was made before (by manage.py "
                             f"migrate or an earlier --apply); to upgrade, apply the migrations after the one it was "
                             f"made with: --since NAME (the newest is {last})")
        for section in after(since):
            try:
                conn.execute(section.sql.encode())  # a script of several statements, with its BEGIN and COMMIT
            except psycopg.Error as error:
                raise StoreError(f"migration {section.name} failed at {where}: {first_line(error)}"
                                 + (f" (ran before it: {', '.join(ran)})" if ran else "")) from None
            ran.append(section.name)
    return ran
