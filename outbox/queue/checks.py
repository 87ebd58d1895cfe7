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
    if not problem.field.isprintable():  # a key from the user's mapping: one with a newline must not make two lines
        return scrub(f"OUTBOX['queues'][{problem.field!r}] {problem.message}", outbox_conf.secret_values())
    path = "".join(part if part.startswith("[") else f"[{part!r}]"
                   for part in re.findall(r"\[[^\]]*\]|[^.\[\]]+", problem.field))
    return scrub(f"OUTBOX['queues']{path} {problem.message}", outbox_conf.secret_values())
