"""Sphinx extension: writes reference/settings.md from the settings' own declarations, so a setting added in code
appears here without anyone writing it twice: OUTBOX's keys (conf.MEANINGS and their defaults), the engine's
limits (harvest.config.Limits: default, least and most value, and conf.LIMIT_MEANINGS), OUTBOX["queues"]
(outbox.queue.app_settings, QueueLimits) and every check code (settings_problems.CHECK_CODES,
app_settings.CHECK_CODES). tests/unit/test_docs.py holds every known key to having a meaning there."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _value(value: Any) -> str:
    return f"`{value!r}`"


def settings_markdown() -> str:
    from outbox import conf, settings_problems
    from outbox.harvest.config import Limits
    from outbox.queue import app_settings

    out = ["# Settings", "",
           "Everything goes in one dict, `OUTBOX = {...}` in `settings.py`, read the same way by `stash()`, the "
           "admin and the harvester; durations are seconds (a `timedelta` works too). A bad value fails "
           "`manage.py check` with one line naming the key and the limit, and a code (below). This page is written "
           "from the code at every build.", "",
           "## `OUTBOX`", "", "| key | default | meaning |", "|---|---|---|"]
    for key, (default, meaning) in conf.MEANINGS.items():
        out.append(f"| `{key}` | {_cell(default or _value(conf.setting(key)))} | {_cell(meaning)} |")
    out += ["", "## Limits", "",
            "Timing and sizing limits of the harvester, in `OUTBOX` beside the keys above (and as `manage.py "
            "harvest` flags); goharvest's names where it has them. The defaults are chosen for speed on a stock "
            "Postgres, with the figures in [tuning](../tuning.md#choosing-the-limits).", "",
            "| limit | default | least | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(Limits):
        default, meaning = conf.LIMIT_MEANINGS.get(field.name, (None, field.metadata.get("doc", "")))
        least = field.metadata.get("minimum")
        out.append(f"| `{field.name}` | {_cell(default or _value(field.default))} | "
                   f"{'' if least is None else _cell(str(least))} | {_cell(meaning)} |")
    for name, (default, meaning) in conf.LIMIT_MEANINGS.items():
        if name not in {f.name for f in dataclasses.fields(Limits)}:
            out.append(f"| `{name}` | {_cell(default)} |  | {_cell(meaning)} |")
    out += ["", "## `OUTBOX[\"queues\"]`", "",
            "The queues' settings ([queues](../queues.md)); the limits among them may also be set per queue, in "
            "`per_queue`.", "", "| key | default | meaning |", "|---|---|---|"]
    for key, (default, meaning) in app_settings.MEANINGS.items():
        out.append(f"| `{key}` | {_cell(default)} | {_cell(meaning)} |")
    out += ["", "## Check codes", "", "| code | what |", "|---|---|"]
    for code, what in {**settings_problems.CHECK_CODES, **app_settings.CHECK_CODES}.items():
        out.append(f"| `{code}` | {_cell(what)} |")
    return "\n".join(out) + "\n"


def write(app: Any, config: Any) -> None:
    target = Path(app.srcdir) / "reference" / "settings.md"
    text = settings_markdown()
    if not target.exists() or target.read_text() != text:
        target.parent.mkdir(exist_ok=True)
        target.write_text(text)


def setup(app: Any) -> dict[str, bool]:
    app.connect("config-inited", write)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
