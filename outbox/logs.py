"""The management commands' logging: visible when the project configured none, secrets masked either way; and a
recurring failure said once (SaidOnce)."""

from __future__ import annotations

import logging
import sys

from outbox.kafka.redaction import RedactingFilter

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(verbosity: int) -> None:
    """Show the `outbox` loggers at the command's verbosity (0 warnings, 1 info, 2+ debug) when the
    project has not configured them, and mask secrets on every handler that carries their lines. psycopg's own
    warnings (a pipeline ended on a lost connection) go to the same handler when nothing hears them: Python's last
    resort would print them bare, with no time, level or logger, and unmasked."""
    logger = logging.getLogger("outbox")
    if not logger.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
        logger.setLevel({0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG))
        if not logging.getLogger("psycopg").hasHandlers():
            logging.getLogger("psycopg").addHandler(handler)
    install_redaction()


def install_redaction() -> None:
    """Put a RedactingFilter on each handler between the `outbox` loggers and the root (once)."""
    logger: logging.Logger | None = logging.getLogger("outbox")
    while logger is not None:
        for handler in logger.handlers:
            if not any(isinstance(f, RedactingFilter) for f in handler.filters):
                handler.addFilter(RedactingFilter())
        logger = logger.parent if logger.propagate else None


class SaidOnce:
    """A failure that recurs (every interval, every pass) logged once, as `message` % the first failure's args, until
    it ends; its end logged as `back`, if given."""

    def __init__(self, logger: logging.Logger, message: str, back: str | None = None) -> None:
        self._logger, self._message, self._back = logger, message, back
        self.on = False

    def failed(self, *args: object) -> None:
        if not self.on:
            self._logger.warning(self._message, *args)
        self.on = True

    def ended(self) -> None:
        if self.on and self._back:
            self._logger.info(self._back)
        self.on = False
