"""Tenant schemas (django-tenants style: one schema per tenant, the same tables in each): which schemas
of a database hold an outbox table, so one process harvests each of them (outboxes.py).

    find_tenant_tables(conn, "outbox", exclude={"public"})   # {"acme.outbox": 16384, "globex.outbox": 16402}

A schema counts when it has an ordinary or partitioned table of that name (not a partition, a view or
another kind of relation); whether the table really is an outbox (its columns, its NOTIFY trigger) the
engine that harvests it checks when it starts, and says so in one line if not.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

import psycopg

from outbox.harvest.config import TABLE_PATTERN

log = logging.getLogger("outbox.harvest.tenants")

# The schemas holding an ordinary or partitioned table named %(table)s, system schemas left out. One
# statement per rescan (outboxes.py), whatever the number of tenants.
TENANT_SCHEMAS = """
SELECT n.nspname, c.oid
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relname = %(table)s AND c.relkind IN ('r', 'p') AND NOT c.relispartition
  AND n.nspname <> 'information_schema' AND n.nspname NOT LIKE 'pg\\_%%'
ORDER BY n.nspname
"""


def find_tenant_tables(conn: psycopg.Connection, table: str, *, exclude: Collection[str] = (),
                       skipped: set[str] | None = None) -> dict[str, int]:
    """`schema.table` for each schema holding `table` (unqualified), minus `exclude`, sorted by schema, with
    the table's oid (its NOTIFY channel and fence name it: a table created again is another table).

    A schema whose name the engine cannot take (not an SQL identifier of at most 63 characters) is left
    out with a warning, once per name remembered in `skipped`."""
    if "." in table:
        raise ValueError(f"table: the tenant schemas' table must be unqualified (no schema), got {table!r}")
    skipped = set() if skipped is None else skipped
    found = {}
    for schema, oid in conn.execute(TENANT_SCHEMAS, {"table": table}).fetchall():
        qualified = f"{schema}.{table}"
        if schema in exclude or schema in skipped:
            continue
        if not TABLE_PATTERN.fullmatch(qualified):
            log.warning("Schema %r has a table %s but its name is not an SQL identifier: not harvested", schema, table)
            skipped.add(schema)
            continue
        found[qualified] = oid
    return found
