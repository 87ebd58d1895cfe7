"""System checks: `manage.py check` fails on a bad OUTBOX["queues"] setting, with a stable error code."""

from __future__ import annotations

import re
from typing import Any

from django.core import checks

from outbox import conf as outbox_conf
from outbox.kafka.problems import Problem
from outbox.kafka.redaction import scrub
from outbox.queue import app_settings

HINT = "Every OUTBOX['queues'] setting, its limit and each check code: the documentation's settings reference."


@checks.register("outbox_queue")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    errors = [checks.Error(_text(p), hint=HINT, id=f"outbox_queue.{p.code}") for p in app_settings.problems()]
    return errors + [checks.Warning(_text(p), hint=HINT, id=f"outbox_queue.{p.code}") for p in app_settings.warnings()]


def _text(problem: Problem) -> str:
    """One line naming the setting as the user wrote it, as the outbox's checks do:
    OUTBOX['queues']['per_queue']['alpha']['backend'] must be one of ..."""
    if problem.field.startswith("OUTBOX"):
        return scrub(f"{problem.field} {problem.message}", outbox_conf.secret_values())
    # A queue's own key is named per_queue['<queue, as repr() writes it>'].<key>; any other field is one key of the
    # user's mapping, written as repr() writes it (a newline in it must not make two lines).
    queue = re.fullmatch(r"per_queue(\[.*\])(?:\.(\w+))?", problem.field, re.S)
    if queue is None:
        path = f"[{problem.field!r}]"
    else:
        path = f"['per_queue']{queue.group(1)}" + (f"[{queue.group(2)!r}]" if queue.group(2) else "")
    return scrub(f"OUTBOX['queues']{path} {problem.message}", outbox_conf.secret_values())
