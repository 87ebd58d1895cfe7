"""`manage.py harvest_health`: a liveness/readiness probe for harvester replicas. Exit 0 healthy, 1 not.

It reads the replicas' status rows, so it runs beside the harvester (an exec probe in the same
pod) or anywhere with database access. One line on stdout says why.
"""

from __future__ import annotations

import socket
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import DatabaseError
from django.utils import timezone

from outbox import conf
from outbox.models import HarvesterStatus


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
        if not healthy:
            raise SystemExit(1)

    def check_health(self, name: str | None, host: str | None, any: bool, require_leader: bool,
                     **_: Any) -> tuple[bool, str]:
        gone_after = conf.setting("status_gone_after")
        try:
            rows = list(HarvesterStatus.objects.all())
        except DatabaseError as error:
            return False, f"cannot read harvester status: {str(error).strip().splitlines()[0]}"
        now = timezone.now()
        if name:
            mine, scope = [r for r in rows if r.name == name], f"replica {name!r}"
        elif any:
            mine, scope = rows, "any replica"
        else:
            host = host or socket.gethostname()
            mine, scope = [r for r in rows if r.host == host], f"replicas on host {host!r}"
        live = [r for r in mine if (now - r.last_seen).total_seconds() <= gone_after]
        if not live:
            seen = max((r.last_seen for r in mine), default=None)
            when = f"last seen {(now - seen).total_seconds():.0f}s ago" if seen else "never seen"
            return False, f"no live harvester for {scope} ({when}; gone after {gone_after:g}s)"
        leaders = [r for r in rows if r.state == "leader" and (now - r.last_seen).total_seconds() <= gone_after]
        if require_leader and not leaders:
            return False, f"{len(live)} live replica(s) for {scope}, but none leads"
        best = next((r for r in live if r.state == "leader"), live[0])
        age = (now - best.last_seen).total_seconds()
        detail = f"{best.name} is {best.state}"
        if best.state == "leader":
            detail += f" ({best.throughput:.0f} records/s, {best.in_flight} in flight)"
        return True, f"{detail}, seen {age:.1f}s ago; {len(live)} live replica(s) for {scope}"
