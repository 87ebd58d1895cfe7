"""A hard deadline behind pytest-timeout's: a test stuck inside C ends its worker, with every thread's stack.

pytest-timeout's signal method raises in the test when its SIGALRM handler runs, and Python runs signal handlers
only between bytecodes: a test blocked inside a C call that never returns (librdkafka's close or flush, a socket
read) outlives its timeout, and the whole run waits until CI's own limit ends it without a word. So each test
also arms faulthandler's watchdog thread, which runs in C: a grace period after pytest-timeout's deadline it
writes every thread's stack to the terminal and ends the process. Under pytest-xdist the controller then reports
the test as failed ("worker crashed") and starts another worker; the rest of the run goes on.
"""

from __future__ import annotations

import faulthandler
import os
from typing import IO, Any

import pytest

_terminal: IO[str] | None = None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("timeout_grace", "seconds past pytest-timeout's deadline before a test stuck in C ends its process",
                  default="60")


def pytest_configure(config: pytest.Config) -> None:
    # The terminal's stderr, duplicated before output capture points file descriptor 2 at a temporary file
    # (pytest's own faulthandler plugin does the same): a stack written to the captured descriptor would be lost
    # with the process.
    global _terminal
    if _terminal is None:
        _terminal = os.fdopen(os.dup(2), "w")


def pytest_unconfigure(config: pytest.Config) -> None:
    global _terminal
    if _terminal is not None:
        faulthandler.cancel_dump_traceback_later()
        _terminal.close()
        _terminal = None


# pytest-timeout's own hooks (each returns None, so its timer is set and cancelled too): the watchdog follows the
# timeout pytest-timeout resolved for the test (its mark, the command line, the environment, the ini), and where
# it runs it (the whole protocol, or the test function alone with func_only).


def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> None:
    if _terminal is not None:
        grace = float(item.config.getini("timeout_grace"))
        faulthandler.dump_traceback_later(settings.timeout + grace, exit=True, file=_terminal)


def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    faulthandler.cancel_dump_traceback_later()
