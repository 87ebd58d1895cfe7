"""System checks: `manage.py check` fails on a bad OUTBOX setting, with a stable error code."""

from __future__ import annotations

from typing import Any

from django.core import checks

from outbox import conf


@checks.register("outbox")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    hint = "See the configuration reference in README.md."
    errors = [checks.Error(f"OUTBOX {p}", hint=hint, id=f"outbox.{p.code}") for p in conf.problems()]
    return errors + [checks.Warning(f"OUTBOX {p}", hint=hint, id=f"outbox.{p.code}") for p in conf.warnings()]
