"""`manage.py harvest_health`: a liveness/readiness probe for harvester replicas. Exit 0 healthy, 1 not.

It reads the replicas' status rows, so it runs beside the harvester (an exec probe in the same
pod) or anywhere with database access. One line on stdout says why, and counts the held and
parked records (outbox.states). A replica blocked by another's database fence is unhealthy. A second
line warns when something holds the database's horizon back (outbox.horizon).
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import DatabaseError

from outbox import conf, horizon
from outbox.harvest import replicas
from outbox.reasons import first_line
from outbox.states import Facts, everywhere, parked_count


class Command(BaseCommand):
    help = "Check harvester replicas through their status rows; exit 0 if healthy, 1 with a reason if not."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--name", help="check the replica with this --name")
        parser.add_argument("--host", help="check replicas on this host (default: this host, unless --name or --any)")
        parser.add_argument("--any", action="store_true", help="check all replicas, wherever they run")
        parser.add_argument("--require-leader", action="store_true",
                            help="also fail unless some live replica leads (for alerting, not liveness)")

    def handle(self, *args: Any, **options: Any) -> None:
        healthy, reason = self.check_health(**options)
        self.stdout.write(f"{'ok' if healthy else 'unhealthy'}: {reason}")
        held_back = self.horizon()
        if held_back is not None:
            # Harvesting does not wait for it, so it does not make a replica unhealthy: it is said, for the operator.
            self.stdout.write(f"warning: {held_back}")
        if not healthy:
            raise SystemExit(1)

    @staticmethod
    def horizon() -> str | None:
        try:
            found = horizon.read(conf.database_alias())
        except DatabaseError:
            return None  # the status rows' reading says what is wrong with the database
        return found.message() if found.held_back else None

    def check_health(self, name: str | None, host: str | None, any: bool, require_leader: bool,
                     **_: Any) -> tuple[bool, str]:
        """The verdict on the status rows of every database the project's outboxes live in (OUTBOX's, and those
        OUTBOX["outboxes"] names: each engine writes its row in its own outbox's database); held and parked
        records are OUTBOX's database's."""
        try:
            facts = Facts.read(conf.database_alias())
            parked = parked_count(conf.database_alias())
        except DatabaseError as error:
            return False, f"cannot read harvester status: {first_line(error)}"
        # Another database that cannot be read is said, and judges nothing: a replica whose outboxes are all here
        # stays healthy (a liveness probe must not restart every harvester because one database is away).
        found, unread = everywhere(facts)
        counts = "; ".join([f"{len(facts.held)} held, {parked} parked", *unread])
        return replicas.health(found, facts.now, name=name, host=host, any=any, require_leader=require_leader,
                               gone_after=conf.setting("status_gone_after"), counts=counts)
