"""`manage.py outbox_consume --queue NAME --handler dotted.path`: process a queue until SIGTERM or SIGINT.

Each message goes to the handler on one of --workers threads and is acked when the handler
returns. A Retry exception redelivers it after Retry's delay; any other exception after the
redelivery timeout. SIGTERM stops receiving, lets the handlers finish the messages in hand,
hands back the messages never started, and exits 0.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError, connections
from django.utils.module_loading import import_string

from outbox.errors import InvalidRecord
from outbox.queue import api, app_settings, cli, metrics, store
from outbox.queue.errors import QueueError
from outbox.queue.models import InboxEntry
from outbox.queue.runner import Handler, HandlerRunner
from outbox.queue.status import QueueStatusReporter, consumer_status
from outbox.reasons import first_line
from outbox.stopping import on_stop_signals

log = logging.getLogger("outbox.queue")
#: How often the inbox is pruned of rows older than inbox_retention.
INBOX_PRUNE_INTERVAL = 3600.0


class Command(BaseCommand):
    help = "Process the messages of a queue with a handler function, acking each when the handler returns."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--queue", required=True, help="the logical queue to consume")
        parser.add_argument("--handler", required=True, metavar="DOTTED.PATH",
                            help="function called with each message (a outbox.queue.Message)")
        parser.add_argument("--workers", type=int, default=1, metavar="N",
                            help="threads running the handler (default 1; at most max_in_progress)")
        parser.add_argument("--redelivery-timeout", type=float, metavar="SECONDS",
                            help="a message this process stops keeping alive is redelivered after this long")
        parser.add_argument("--keep-alive-interval", type=float, metavar="SECONDS",
                            help="keep-alive markers are sent this often (default: a third of the timeout)")
        parser.add_argument("--max-in-progress", type=int, metavar="N",
                            help="messages held at once, received or buffered (back-pressure)")
        parser.add_argument("--max-deliveries", type=int, metavar="N",
                            help="a message delivered this often goes to the dead letters")
        parser.add_argument("--inbox", action="store_true",
                            help="run the handler in a transaction with an inbox row keyed by the message id, so a "
                                 "redelivered message whose effects committed is acked without running it again")
        parser.add_argument("--database", default="default", metavar="ALIAS",
                            help="database of the handler's transaction with --inbox (default: 'default')")
        cli.add_common_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        name = cli.replica_name(options["name"])
        problems = app_settings.problems()
        if problems:
            raise CommandError("invalid setting: " + "; ".join(map(app_settings.describe, problems)))
        queue, workers = options["queue"], options["workers"]
        handler = self._handler(options["handler"])
        config = app_settings.queue_config()
        try:
            api.validate_queue(queue)
        except InvalidRecord as error:
            raise CommandError(f"--queue: {str(error).removeprefix('queue: ')}") from None
        limits = api.limits_for(config, queue, redelivery_timeout=options["redelivery_timeout"],
                                keep_alive_interval=options["keep_alive_interval"],
                                max_in_progress=options["max_in_progress"], max_deliveries=options["max_deliveries"])
        problems = limits.problems()
        if problems:
            raise CommandError("; ".join(f"--{str(p).replace('_', '-')}" for p in problems))
        if workers < 1 or workers > limits.max_in_progress:
            raise CommandError(f"--workers: must be from 1 to max_in_progress ({limits.max_in_progress}), got "
                               f"{workers}; raise --max-in-progress to run more")
        if options["inbox"] and options["database"] not in connections:
            there = ", ".join(repr(alias) for alias in connections.settings) or "none"
            raise CommandError(f"--database: must name an entry of DATABASES, got {options['database']!r} "
                               f"(DATABASES has {there})")
        if options["inbox"]:
            try:
                store.require_tables(InboxEntry, using=options["database"])
            except store.DatabaseUnavailable as error:
                raise CommandError(str(error)) from None
        cli.configure_logging(options["verbosity"])
        cli.require_metrics(options["metrics_port"])
        consumer = api.new_consumer(config, queue, limits=limits, name=name, instruments=metrics.default_instruments())
        try:
            consumer.start()
        except QueueError as error:
            raise CommandError(str(error)) from None
        runner = HandlerRunner(consumer, handler, workers=workers, inbox=options["inbox"], using=options["database"])
        # A share queue has no trackers: its consumers count the broker's redeliveries and their dead letters, for
        # the Queues table and the charts, as a markers queue's trackers do.
        share = limits.backend == "share"
        reporter = QueueStatusReporter(name, "consumer", queue=queue,
                                       interval=app_settings.setting("status_interval"),
                                       snapshot=lambda: consumer_status(consumer, runner, options["handler"]),
                                       totals=(lambda: ({queue: consumer.redelivered}, {queue: consumer.dead_lettered}))
                                       if share else None,
                                       history_interval=app_settings.setting("history_interval") if share else 0.0,
                                       history_retention=app_settings.setting("history_retention"))
        try:
            cli.serve_metrics(options["metrics_port"], options["metrics_address"],
                              lambda: metrics.consumer_gauges(queue, name, lambda: consumer.in_progress,
                                                              consumer.waiting_for))
            runner.start()
            reporter.start()
            with on_stop_signals(runner.stop):
                next_prune = time.monotonic()
                while not runner.join(timeout=0.5):
                    if options["inbox"] and time.monotonic() >= next_prune:
                        next_prune = time.monotonic() + INBOX_PRUNE_INTERVAL
                        self._prune(options["database"])
        finally:
            runner.stop()
            runner.join()
            consumer.close(timeout=5.0)
            reporter.stop()
        if runner.failure is not None:
            raise CommandError(str(runner.failure))

    @staticmethod
    def _handler(path: str) -> Handler:
        try:
            handler = import_string(path)
        except ImportError as error:
            raise CommandError(f"--handler: cannot import {path!r}: {error}") from None
        if not callable(handler):
            raise CommandError(f"--handler: {path!r} is not callable")
        return handler

    @staticmethod
    def _prune(using: str) -> None:
        try:
            deleted = store.prune_inbox(app_settings.setting("inbox_retention"), using)
        except DatabaseError as error:
            log.warning("Could not prune the inbox: %s", first_line(error))
            return
        if deleted:
            log.info("Pruned %d inbox row(s)", deleted)

