"""What the queue's management commands share: names, masked errors, logging, metrics."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from django.core.management.base import CommandError, CommandParser

from outbox import conf as outbox_conf
from outbox import logs
from outbox.kafka.names import default_name, name_problem
from outbox.kafka.redaction import scrub
from outbox.metrics_endpoint import EndpointFailure, add_metrics_flags

log = logging.getLogger("outbox.queue")


def add_common_arguments(parser: CommandParser) -> None:
    parser.add_argument("--name", help="this process's name in logs and status rows (default: host_pid_time)")
    add_metrics_flags(parser)


def replica_name(name: str | None) -> str:
    """--name as given (refused in one line if it could forge a log line), else host_pid_time."""
    if name is None:
        return default_name()
    problem = name_problem(name)
    if problem is not None:
        raise CommandError(f"--name: {problem}")
    return name


def masked(message: str) -> str:
    """A command's one-line error with the settings' secret values masked, should it quote one."""
    return scrub(message, outbox_conf.secret_values())


def configure_logging(verbosity: int) -> None:
    """Make the queue's log visible when the project has not configured the `outbox` loggers (secrets masked)."""
    logs.configure_logging(verbosity)


def require_metrics(port: int | None) -> None:
    """Fail before connecting anywhere when --metrics-port is given without prometheus-client."""
    from outbox.queue import metrics

    if port is not None and not metrics.available():
        raise CommandError(f"--metrics-port needs prometheus-client: {metrics.INSTALL_HINT}")


def serve_metrics(port: int | None, address: str, collector: Callable[[], Any]) -> None:
    if port is None:
        return
    from outbox.queue import metrics

    try:
        port = metrics.serve(port, address, collector())
    except EndpointFailure as error:
        raise CommandError(str(error)) from None
    log.info("Metrics on http://%s:%d/metrics", address, port)

