"""The management commands' logging: visible when the project configured none, secrets masked either way."""

from __future__ import annotations

import logging
import sys

from outbox.kafka.redaction import RedactingFilter

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(verbosity: int) -> None:
    """Show the `outbox` loggers at the command's verbosity (0 warnings, 1 info, 2+ debug) when the
    project has not configured them, and mask secrets on every handler that carries their lines."""
    logger = logging.getLogger("outbox")
    if not logger.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
        logger.setLevel({0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG))
    install_redaction()


def install_redaction() -> None:
    """Put a RedactingFilter on each handler between the `outbox` loggers and the root (once)."""
    logger: logging.Logger | None = logging.getLogger("outbox")
    while logger is not None:
        for handler in logger.handlers:
            if not any(isinstance(f, RedactingFilter) for f in handler.filters):
                handler.addFilter(RedactingFilter())
        logger = logger.parent if logger.propagate else None
