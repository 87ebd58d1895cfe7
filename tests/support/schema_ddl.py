"""The stand-alone harvester's DDL (outbox/harvest/schema.sql) written from the outbox app's migrations, as
`manage.py sqlmigrate` prints them: `python -m tests.support.schema_ddl` rewrites the file after a new migration,
and tests/integration/test_standalone_harvester.py fails while the two differ."""

from __future__ import annotations

import io
import os
from pathlib import Path

HEADER = """\
-- The tables, indexes and trigger django-outbox-harvest's migrations make (the outbox table `outbox`, replica
-- status and history, parked records, shard terms, the NOTIFY trigger), for a database without Django:
-- `outbox-harvest schema` prints it, `outbox-harvest schema --apply` runs it. Written from the migrations
-- (by the project's own tests/support/schema_ddl.py, which a test holds to them). Each section is one
-- migration, named as Django names it, in its own transaction as Django runs it: fed to
-- `psql -v ON_ERROR_STOP=1`, the sections before a failing one stay (plain psql goes on with the next ones).
-- `--apply` runs them all in one transaction instead: all of them, or none.
"""
MARK = "-- migration: "


def render() -> str:
    """Every migration of the outbox app, in order, as sqlmigrate prints it (needs a PostgreSQL connection)."""
    from django.core.management import call_command
    from django.db.migrations.loader import MigrationLoader

    loader = MigrationLoader(None, ignore_no_migrations=True)
    names = sorted(name for app, name in loader.disk_migrations if app == "outbox")
    parts = [HEADER]
    for name in names:
        out = io.StringIO()
        call_command("sqlmigrate", "outbox", name, stdout=out, no_color=True)
        parts.append(f"\n{MARK}{name}\n{out.getvalue().strip()}\n")
    return "".join(parts)


def main() -> None:
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    django.setup()
    from outbox.harvest import schema

    Path(schema.__file__).with_suffix(".sql").write_text(render())
    print(f"wrote {Path(schema.__file__).with_suffix('.sql')}")


if __name__ == "__main__":
    main()
