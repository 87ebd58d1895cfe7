"""`manage.py outbox_redeliver`: a redelivery tracker, until SIGTERM or SIGINT.

Run any number of replicas: they share the markers topic's partitions through one consumer
group, and each rebuilds what it is given from the markers log.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from outbox.kafka.redaction import redact_mapping
from outbox.queue import app_settings, cli, metrics, store
from outbox.queue.errors import QueueError
from outbox.queue.models import DeadLetter, QueueCounter, QueueProcess
from outbox.queue.status import QueueStatusReporter, tracker_status
from outbox.queue.tracker import RedeliveryTracker
from outbox.stopping import on_stop_signals


class Command(BaseCommand):
    help = "Redeliver queue messages that no consumer finished, and dead-letter those delivered too often."

    def add_arguments(self, parser: CommandParser) -> None:
        cli.add_common_arguments(parser)
        parser.add_argument("--print-config", action="store_true",
                            help="print the effective queue configuration (secrets redacted) as JSON and exit")

    def handle(self, *args: Any, **options: Any) -> None:
        name = cli.replica_name(options["name"])
        problems = app_settings.problems()
        if options["print_config"]:
            # Printed even when invalid (that is when it is wanted), then the problems, and a failure.
            try:
                printed = app_settings.queue_config().redacted()
            except (TypeError, ValueError):  # too malformed to build: the settings as given
                printed = redact_mapping(app_settings.raw_settings())
            self.stdout.write(json.dumps(printed, indent=2, default=str))
        if problems:
            raise CommandError("invalid setting: " + "; ".join(map(app_settings.describe, problems)))
        if options["print_config"]:
            return
        config = app_settings.queue_config()
        cli.configure_logging(options["verbosity"])
        cli.require_metrics(options["metrics_port"])
        try:
            store.require_tables(DeadLetter, QueueProcess, QueueCounter)
        except store.DatabaseUnavailable as error:
            raise CommandError(str(error)) from None
        instruments = metrics.default_instruments()
        tracker = RedeliveryTracker(config, dead_letters=store.store_dead_letters, name=name, instruments=instruments)
        try:
            tracker.start()
        except QueueError as error:
            raise CommandError(str(error)) from None
        reporter = QueueStatusReporter(name, "tracker", interval=app_settings.setting("status_interval"),
                                       snapshot=lambda: tracker_status(tracker),
                                       totals=lambda: (tracker.snapshot.redelivered, tracker.snapshot.dead_lettered),
                                       history_interval=app_settings.setting("history_interval"),
                                       history_retention=app_settings.setting("history_retention"),
                                       dead_letter_retention=app_settings.setting("dead_letter_retention"))
        reporter.start()
        try:
            cli.serve_metrics(options["metrics_port"], options["metrics_address"],
                              lambda: metrics.tracker_gauges(lambda: tracker.snapshot, name, tracker.waiting_for))
            with on_stop_signals(tracker.stop):
                while not tracker.wait(timeout=0.5):
                    pass
        except QueueError as error:
            raise CommandError(str(error)) from None
        finally:
            tracker.stop()
            reporter.stop()

