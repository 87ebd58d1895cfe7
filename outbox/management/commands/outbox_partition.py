"""`manage.py outbox_partition`: make the outbox a table partitioned by id range, or show its partitions.

    manage.py outbox_partition --size 1000000     # convert (stop the harvesters first, start them after)
    manage.py outbox_partition --status           # each partition: its ids, rows, dead rows, size

Once partitioned, the leading harvester keeps the table (outbox.harvest.partitions): partitions
ahead of the ids, drained ones truncated and dropped, so dead rows leave with their partition
whatever holds the database's horizon back. docs/tuning.md, "The partitioned outbox".
"""

from __future__ import annotations

from typing import Any

import psycopg
from django.core.management.base import BaseCommand, CommandError, CommandParser

from outbox import conf
from outbox.harvest import partitions
from outbox.harvest.store import StoreError, table_name
from outbox.management.database import connect_or_fail
from outbox.reasons import first_line
from outbox.states import replicas


class Command(BaseCommand):
    help = "Partition the outbox table by id range (the leading harvester then keeps it), or show its partitions."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--size", type=int, default=1_000_000,
                            help="ids per partition (default 1,000,000: about 8 minutes at 2,000 records/s)")
        parser.add_argument("--status", action="store_true", help="list the partitions and exit")
        parser.add_argument("--force", action="store_true",
                            help="convert even while a harvester is seen leading (it must be restarted after)")

    def handle(self, *args: Any, size: int, status: bool, force: bool, **options: Any) -> None:
        config = conf.harvest_config()
        with connect_or_fail(config.dsn) as conn:
            if status:
                self._status(conn, config.table)
                return
            leaders = [r.name for r in replicas().leaders]
            if leaders and not force:
                raise CommandError(f"harvester {', '.join(leaders)} leads on this table: stop every replica first "
                                   f"(the table is renamed and rebuilt), or pass --force and restart them after")
            try:
                made = partitions.convert(conn, config.table, size)
            except (partitions.PartitionError, StoreError) as error:
                raise CommandError(str(error)) from None
            except psycopg.Error as error:
                raise CommandError(f"cannot partition {config.table!r}: {first_line(error)}") from None
        ranges = ", ".join(_ids(p) for p in made if not p.default)
        self.stdout.write(f"Partitioned {config.table!r} by id: {ranges}, and a default partition. Start the "
                          f"harvesters: the leader keeps {partitions.AHEAD} partitions ahead and drops drained ones.")

    def _status(self, conn: psycopg.Connection, table: str) -> None:
        if not partitions.is_partitioned(conn, table):
            self.stdout.write(f"{table!r} is not partitioned (manage.py outbox_partition --size N partitions it).")
            return
        self.stdout.write(f"{'partition':<40} {'ids':<28} {'rows':>10} {'dead rows':>10} {'size':>10}")
        for partition in partitions.partitions(conn, table):
            live, dead, size = conn.execute(
                "SELECT coalesce(n_live_tup, 0), coalesce(n_dead_tup, 0), pg_total_relation_size(%s::regclass) "
                "FROM pg_stat_user_tables WHERE relid = %s::regclass", [partition.name, partition.name]
            ).fetchone() or (0, 0, 0)
            self.stdout.write(f"{partition.name:<40} {_ids(partition):<28} {live:>10,} {dead:>10,} "
                              f"{size / 2**20:>8.1f} MiB")
        last = conn.execute(partitions.LAST_ID, {"table": table_name(table)}).fetchone()[0]
        self.stdout.write(f"last id taken: {last or 0:,}")


def _ids(partition: partitions.Partition) -> str:
    if partition.default:
        return "(default)"
    lo = "-inf" if partition.lo is None else f"{partition.lo:,}"
    hi = "+inf" if partition.hi is None else f"{partition.hi - 1:,}"
    return f"{lo} .. {hi}"
