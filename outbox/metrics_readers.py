"""What `manage.py harvest`'s metrics read from the outbox's Django database at scrape time (outbox/metrics.py
asks; the stand-alone harvester reads the same by psycopg): parked records, the oldest row's age, who holds the
database's horizon back. Each scrape runs on a thread of its own, and leaves no connection behind."""

from __future__ import annotations

import logging
from typing import Any

from django.db import DatabaseError, connections
from django.utils import timezone

from outbox import conf, horizon
from outbox.models import OutboxRecord
from outbox.reasons import first_line
from outbox.states import parked_count

log = logging.getLogger("outbox.metrics")


def read_parked() -> int | None:
    """The dead-letter table's row count, or None (logged) when it cannot be read."""
    try:
        return parked_count().value
    except DatabaseError as error:
        log.warning("Could not count parked records: %s", first_line(error))
        return None
    finally:
        connections.close_all()  # every scrape runs on a thread of its own: leave no connection behind


def read_oldest_age() -> float | None:
    """Seconds since the oldest outbox row was written (0 when the outbox is empty), or None (logged) when it
    cannot be read: one lookup at the primary key's head."""
    try:
        oldest = (OutboxRecord.objects.using(conf.database_alias()).order_by("id")
                  .values_list("create_time", flat=True).first())
    except DatabaseError as error:
        log.warning("Could not read the oldest outbox row: %s", first_line(error))
        return None
    finally:
        connections.close_all()
    return 0.0 if oldest is None else max(0.0, (timezone.now() - oldest).total_seconds())


def read_horizon() -> Any:
    """Who holds the database's horizon back (outbox.horizon), or None (logged) when it cannot be read."""
    try:
        return horizon.read()
    except DatabaseError as error:
        log.warning("Could not read the database's horizon: %s", first_line(error))
        return None
    finally:
        connections.close_all()


#: serve()'s readers, for manage.py harvest.
READERS = {"parked": read_parked, "oldest_age": read_oldest_age, "horizon": read_horizon}
