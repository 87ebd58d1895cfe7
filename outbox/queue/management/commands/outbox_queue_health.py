"""`manage.py outbox_queue_health`: a probe of queue processes (outbox_consume, outbox_redeliver). Exit 0 healthy,
1 not, with one line on stdout saying why.

It reads the processes' status rows, so it runs beside them (an exec probe) or anywhere with database
access. A process is unhealthy when its row is not fresh (not seen for status_gone_after seconds: dead or
frozen) or when it has been waiting for Kafka longer than the group's session timeout and 15 s: alive, but
handling nothing (outbox/kafka/outage.py). A process riding through a short broker restart stays healthy.
"""

from __future__ import annotations

import socket
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import DatabaseError
from django.utils import timezone

from outbox.queue import clients, overview
from outbox.queue.models import QueueProcess
from outbox.reasons import first_line


class Command(BaseCommand):
    help = "Check queue consumers and trackers through their status rows; exit 0 if healthy, 1 with a reason if not."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--name", help="check the process with this --name")
        parser.add_argument("--queue", help="check the consumers of this queue")
        parser.add_argument("--kind", choices=["consumer", "tracker"], help="check only consumers, or only trackers")
        parser.add_argument("--host", help="check processes on this host (default: this host, unless --name or --any)")
        parser.add_argument("--any", action="store_true", help="check all processes, wherever they run")

    def handle(self, *args: Any, **options: Any) -> None:
        healthy, reason = self.check_health(**options)
        self.stdout.write(f"{'ok' if healthy else 'unhealthy'}: {reason}")
        if not healthy:
            raise SystemExit(1)

    @staticmethod
    def check_health(name: str | None, queue: str | None, kind: str | None, host: str | None, any: bool,
                     **_: Any) -> tuple[bool, str]:
        try:
            found = overview.processes()
        except DatabaseError as error:
            return False, f"cannot read queue status: {first_line(error)}"
        scope = [{"consumer": "consumer(s)", "tracker": "tracker(s)"}.get(kind or "", "queue process(es)")]
        host = None if name or any else host or socket.gethostname()

        def matches(row: QueueProcess) -> bool:
            return ((name is None or row.name == name) and (queue is None or row.queue == queue)
                    and (kind is None or row.kind == kind) and (host is None or row.host == host))

        for what, value in (("named", name), ("of queue", queue), ("on host", host)):
            if value:
                scope.append(f"{what} {value!r}")
        described = " ".join(scope)
        live = [row for row in [*found.consumers, *found.trackers] if matches(row)]
        if not live:
            gone = [row for row in found.gone if matches(row)]
            last = max(gone, key=lambda row: row.last_seen, default=None)
            when = "never seen" if last is None else \
                f"{last.name} last seen {(timezone.now() - last.last_seen).total_seconds():.0f}s ago"
            return False, f"no live {described} ({when})"
        now = timezone.now()
        for row in live:
            waiting = (row.stats or {}).get("waiting")
            if not waiting:
                continue
            seconds = float(waiting.get("seconds") or 0) + max(0.0, (now - row.last_seen).total_seconds())
            if seconds > clients.STALL_AFTER:
                return False, (f"{row.kind} {row.name}{_of(row)} has waited {seconds:.0f}s for {waiting.get('for')}, "
                               f"handling nothing (stalled after {clients.STALL_AFTER:g}s)")
        waiting_now = [row for row in live if (row.stats or {}).get("waiting")]
        detail = f"{len(live)} live {described}"
        if waiting_now:
            detail += f", {len(waiting_now)} waiting for Kafka (for less than {clients.STALL_AFTER:g}s)"
        return True, detail


def _of(row: QueueProcess) -> str:
    return f" of queue {row.queue}" if row.queue else ""
