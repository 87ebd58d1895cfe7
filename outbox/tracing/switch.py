"""Whether this process traces the outbox: OUTBOX["tracing"] and whether opentelemetry-api imports.

Decided once and cached, so stash() pays one global read when tracing is off; a change of
settings (Django's setting_changed, as override_settings sends) decides again.
"""

from __future__ import annotations

from typing import Any

from django.core.signals import setting_changed
from django.dispatch import receiver

#: None until first asked; then True or False.
_on: bool | None = None


def tracing_on() -> bool:
    """True when OUTBOX["tracing"] is on (the default) and opentelemetry-api is importable."""
    if _on is None:
        return _decide()
    return _on


def _decide() -> bool:
    global _on
    from outbox import conf

    _on = False
    if conf.setting("tracing") is True:
        try:  # imported, not only found: a broken install must leave tracing off, not make stash() fail
            import opentelemetry.propagate
            import opentelemetry.trace  # noqa: F401
        except ImportError:
            pass
        else:
            _on = True
    return _on


def otel_installed() -> bool:
    """opentelemetry-api can be imported (used by the system check; imports nothing itself)."""
    import importlib.util

    try:
        return importlib.util.find_spec("opentelemetry.trace") is not None
    except (ImportError, ValueError):
        return False


def reset() -> None:
    """Decide again at the next stash() (settings changed)."""
    global _on
    _on = None


@receiver(setting_changed)
def _settings_changed(setting: str, **kwargs: Any) -> None:
    if setting == "OUTBOX":
        reset()
