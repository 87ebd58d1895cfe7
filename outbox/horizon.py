"""Who holds the database's horizon back (outbox/harvest/horizon.py), read on a Django database: the dashboard,
`harvest_health` and `manage.py harvest`'s metrics."""

from __future__ import annotations

from django.db import connections

from outbox import conf
from outbox.harvest.horizon import Holder, Horizon, read_with

__all__ = ["Holder", "Horizon", "read"]


def read(using: str | None = None) -> Horizon:
    """What holds the horizon back now and the outbox's dead rows, on the outbox's database."""
    from outbox.models import OutboxRecord

    using = using or conf.database_alias()
    with connections[using].cursor() as cursor:
        return read_with(cursor, OutboxRecord._meta.db_table, float(conf.setting("horizon_warn_after")))
