"""System checks: `manage.py check` fails on a bad OUTBOX setting, with a stable error code."""

from __future__ import annotations

from typing import Any

from django.core import checks

from outbox import conf
from outbox.harvest.config import Problem


@checks.register("outbox")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    hint = "See the configuration reference in README.md."
    errors = [checks.Error(describe(p), hint=hint, id=f"outbox.{p.code}") for p in conf.problems()]
    return errors + [checks.Warning(describe(p), hint=hint, id=f"outbox.{p.code}") for p in conf.warnings()]


def describe(problem: Problem) -> str:
    """One line naming the setting: OUTBOX['max_in_flight_records'] must be at least 1, got 0."""
    where = "OUTBOX" if problem.field == "OUTBOX" else f"OUTBOX[{problem.field!r}]"
    return f"{where} {problem.message}"
