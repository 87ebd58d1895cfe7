"""System checks: `manage.py check` fails on a bad OUTBOX["queues"] setting, with a stable error code."""

from __future__ import annotations

from typing import Any

from django.core import checks

from outbox.queue import app_settings

HINT = "Every OUTBOX['queues'] setting, its limit and each check code: the documentation's settings reference."


@checks.register("outbox_queue")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    describe = app_settings.describe
    errors = [checks.Error(describe(p), hint=HINT, id=f"outbox_queue.{p.code}") for p in app_settings.problems()]
    return errors + [checks.Warning(describe(p), hint=HINT, id=f"outbox_queue.{p.code}")
                     for p in app_settings.warnings()]
