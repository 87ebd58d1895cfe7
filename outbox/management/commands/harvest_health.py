"""`manage.py harvest_health`: a liveness/readiness probe for harvester replicas. Exit 0 healthy, 1 not.

It reads the replicas' status rows, so it runs beside the harvester (an exec probe in the same
pod) or anywhere with database access. One line on stdout says why, and counts the held and
parked records (outbox.states). A replica blocked by another's database fence is unhealthy. A second
line warns when something holds the database's horizon back (outbox.horizon).
"""

from __future__ import annotations

import socket
from datetime import UTC
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import DatabaseError

from outbox import conf, horizon
from outbox.harvest import sharding
from outbox.harvest.events import rate_text
from outbox.reasons import first_line
from outbox.states import Facts, parked_count, shards_without_leader


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
        gone_after = conf.setting("status_gone_after")
        try:
            facts = Facts.read(conf.database_alias())
            parked = parked_count(conf.database_alias())
        except DatabaseError as error:
            return False, f"cannot read harvester status: {first_line(error)}"
        found = facts.replicas
        if name:
            # A sharded replica's engines report rows of their own (one per shard it leads), and so do a process's
            # outboxes when it harvests several (`replica-a/shop`: outbox/many.py).
            scope = f"replica {name!r}"

            def matches(r: Any) -> bool:
                return r.name == name or (r.shard is not None and sharding.replica_of(r.name, r.shard) == name) \
                    or ("/" not in name and r.name.partition("/")[0] == name)
        elif any:
            scope, matches = "any replica", lambda r: True
        else:
            host = host or socket.gethostname()
            scope, matches = f"replicas on host {host!r}", lambda r: r.host == host
        counts = f"{len(facts.held)} held, {parked} parked"
        live = [r for r in found.live if matches(r)]
        if not live:
            last = max((r for r in [*found.gone, *found.stopped] if matches(r)), key=lambda r: r.last_seen,
                       default=None)
            if last is None:
                when = "never seen"
            elif last in found.stopped:
                when = (f"{last.name} stopped cleanly at {last.last_seen.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC, "
                        f"{(facts.now - last.last_seen).total_seconds():.0f}s ago")
            else:
                when = f"{last.name} last seen {(facts.now - last.last_seen).total_seconds():.0f}s ago"
            return False, f"no live harvester for {scope} ({when}; gone after {gone_after:g}s); {counts}"
        blocked = [r for r in found.blocked if matches(r)]
        if blocked:
            r = blocked[0]
            return False, (f"{r.name} (leader group {r.leader_group}) is blocked: {r.blocked_by or 'another replica'} "
                           f"holds the table's database fence, so it publishes nothing; {counts}")
        if require_leader and not found.leaders:
            return False, f"{len(live)} live replica(s) for {scope}, but none leads; {counts}"
        leaderless = shards_without_leader(found)
        if require_leader and leaderless:
            group, shards, missing = leaderless[0]
            return False, (f"group {group} has {shards} shards and no live replica leads shard(s) "
                           f"{', '.join(map(str, missing))}; {counts}")
        best = next((r for r in live if r in found.leaders), live[0])
        age = (facts.now - best.last_seen).total_seconds()
        detail = f"{best.name} is {best.state}"
        engines = [r for r in found.leaders if matches(r) and r.shard is not None]
        if engines:  # sharded replicas: what each one's engines lead, named by the replica that leads them
            detail = "; ".join(
                f"{replica} leads shard(s) {', '.join(str(r.shard) for r in led)} of {led[0].shards} "
                f"({rate_text(sum(r.throughput for r in led))} records/s, {sum(r.in_flight for r in led):,} in flight)"
                for replica, led in _by_replica(engines))
        elif best in found.leaders:
            detail += f" ({rate_text(best.throughput)} records/s, {best.in_flight:,} in flight)"
        return True, f"{detail}, seen {age:.1f}s ago; {len(live)} live replica(s) for {scope}; {counts}"


def _by_replica(engines: list[Any]) -> list[tuple[str, list[Any]]]:
    """Shard engines' rows grouped by the replica each belongs to (its name without the shard's suffix),
    the replicas in name order and each one's shards in order."""
    grouped: dict[str, list[Any]] = {}
    for row in sorted(engines, key=lambda r: (r.leader_group, r.shard)):
        grouped.setdefault(sharding.replica_of(row.name, row.shard), []).append(row)
    return sorted(grouped.items())
