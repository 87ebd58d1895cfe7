"""`manage.py outbox_reshard --shards M`: change how many shards a group harvests the outbox in.

    manage.py outbox_reshard --shards 6     # stop the group's replicas first; start them with --shards 6 after

What it does, and why it is safe, is harvest/reshard.py's (shared with `outbox-harvest reshard`): it refuses
while any leader of the table holds a fence, gives the leader topic one partition per new shard, and builds
the new N's index (dropping the old ones). This command only builds the configuration from OUTBOX.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from outbox import conf
from outbox.harvest.reshard import ReshardRefused, reshard


class Command(BaseCommand):
    help = "Change the number of shards of the outbox's leader group (stop its replicas first)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--shards", type=int, required=True, metavar="M", help="the new number of shards")
        parser.add_argument("--leader-topic", help="the group's leader topic (default: as manage.py harvest)")
        parser.add_argument("--database", help="Django database alias holding the table (default: 'default')")
        parser.add_argument("--table", help="outbox table (default: OUTBOX['table'])")

    def handle(self, *args: Any, shards: int, **options: Any) -> None:
        config = conf.harvest_config(leader_topic=options["leader_topic"], database=options["database"],
                                     table=options["table"], shards=shards)
        try:
            done = reshard(config, shards)
        except ReshardRefused as error:
            raise CommandError(str(error)) from None
        self.stdout.write(f"{done} Start the replicas with --shards {shards} (or OUTBOX['shards'] = {shards}).")
