"""The long-running commands' logging where the project configured none (outbox/logs.py), in a process of its own
as the commands meet it: their lines and psycopg's warnings alike have a time, a level and a logger's name, and
secrets masked."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import logging
from outbox.kafka.redaction import remember_secrets
from outbox.logs import configure_logging

remember_secrets("postgresql://app:s3cret-pw@db/shop")
configure_logging(1)
logging.getLogger("outbox.harvest").info("Harvesting outbox")
logging.getLogger("psycopg").warning("error ignored terminating %r: %s", "<psycopg.Pipeline [BAD]>",
                                     "the connection is lost (password s3cret-pw)")
logging.getLogger("psycopg.pool").info("not heard: psycopg's own level stays Python's default")
"""


def test_psycopgs_warnings_are_formatted_and_masked_like_the_commands_own_lines():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    assert len(lines) == 2, lines
    assert re.fullmatch(rf"{stamp} INFO outbox.harvest: Harvesting outbox", lines[0]), lines
    assert re.fullmatch(rf"{stamp} WARNING psycopg: error ignored terminating '<psycopg.Pipeline \[BAD\]>': the "
                        rf"connection is lost \(password \*+\)", lines[1]), lines
