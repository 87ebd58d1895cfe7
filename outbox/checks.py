"""System checks: `manage.py check` fails on a bad OUTBOX setting, with a stable error code."""

from __future__ import annotations

from typing import Any

from django.core import checks

from outbox import conf


@checks.register("outbox")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    return [
        checks.Error(f"OUTBOX {problem}", hint="See the configuration reference in README.md.",
                     id=f"outbox.{problem.code}")
        for problem in conf.problems()
    ]
