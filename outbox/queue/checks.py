"""System checks: `manage.py check` fails on a bad OUTBOX["queues"] setting, with a stable error code."""

from __future__ import annotations

from typing import Any

from django.core import checks

from outbox import conf as outbox_conf
from outbox.kafka.problems import Problem
from outbox.kafka.redaction import scrub
from outbox.queue import app_settings

HINT = "See docs/queues.md for OUTBOX['queues']."


@checks.register("outbox_queue")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    errors = [checks.Error(_text(p), hint=HINT, id=f"outbox_queue.{p.code}") for p in app_settings.problems()]
    return errors + [checks.Warning(_text(p), hint=HINT, id=f"outbox_queue.{p.code}") for p in app_settings.warnings()]


def _text(problem: Problem) -> str:
    text = str(problem) if problem.field.startswith("OUTBOX") else f"OUTBOX['queues'] {problem}"
    return scrub(text, outbox_conf.secret_values())
