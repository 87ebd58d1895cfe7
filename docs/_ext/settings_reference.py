"""Sphinx extension: writes reference/settings.md from the settings' own declarations, so a setting added in code
appears here without anyone writing it twice: each key is a field of a settings dataclass holding its default,
meaning and rule (outbox/kafka/keys.py): OUTBOX's own keys (conf.OutboxKeys), the engine's (harvest.config
.HarvestConfig) and its limits (Limits, with their least values), an OUTBOX["outboxes"] entry's (many.OutboxEntry),
OUTBOX["queues"] (queue.config.QueueConfig and
QueueLimits); and every check code (settings_problems.CHECK_CODES, app_settings.CHECK_CODES).
tests/unit/test_docs.py holds every known key to a line here."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _rows(*sections: type) -> list[tuple[str, str, Any, str]]:
    """(name, default as shown, least value, meaning) of each field with a meaning."""
    from outbox.kafka.keys import shown_default

    return [(spec.name, shown_default(spec), spec.metadata.get("minimum"), spec.metadata["doc"])
            for section in sections for spec in dataclasses.fields(section) if "doc" in spec.metadata]


def settings_markdown() -> str:
    from outbox import conf, settings_problems
    from outbox.harvest.config import HarvestConfig, Limits
    from outbox.many import OutboxEntry
    from outbox.queue import app_settings
    from outbox.queue.config import QueueConfig, QueueLimits

    out = ["# Settings", "",
           "Everything goes in one dict, `OUTBOX = {...}` in `settings.py`, read the same way by `stash()`, the "
           "admin and the harvester; durations are seconds (a `timedelta` works too). A bad value fails "
           "`manage.py check` with one line naming the key and the limit, and a code (below). This page is written "
           "from the code at every build.", "",
           "## `OUTBOX`", "", "| key | default | meaning |", "|---|---|---|"]
    rows = [(name, shown, meaning) for name, shown, _, meaning in _rows(conf.OutboxKeys, HarvestConfig)]
    rows += [(name, "`{}`", meaning) for name, (_, meaning) in conf.APP_KEYS.items()]
    rows += [(name, "none", f"retired: accepted with `outbox.W004`, does nothing ({why})")
             for name, why in conf.RETIRED_KEYS.items()]
    out += [f"| `{name}` | {_cell(shown)} | {_cell(meaning)} |" for name, shown, meaning in rows]
    out += ["", "## An entry of `OUTBOX[\"outboxes\"]`", "",
            "Each outbox of a process that harvests several ([scaling](../scaling.md#many-outboxes-in-one-process)) "
            "gets OUTBOX's settings, with what its entry sets. `outbox-harvest`'s file lists them as "
            "`[outboxes.NAME]` tables with the same keys, `dsn` in place of `database` "
            "([without Django](../standalone.md#several-outboxes-in-one-process)):", "",
            "| key | default | meaning |", "|---|---|---|"]
    out += [f"| `{name}` | {_cell(shown)} | {_cell(meaning)} |" for name, shown, _, meaning in _rows(OutboxEntry)]
    out += ["", "## Limits", "",
            "Timing and sizing limits of the harvester, in `OUTBOX` beside the keys above (and as `manage.py "
            "harvest` flags); goharvest's names where it has them. The defaults are chosen for speed on a stock "
            "Postgres, with the figures in [tuning](../tuning.md#choosing-the-limits).", "",
            "| limit | default | least | meaning |", "|---|---|---|---|"]
    out += [f"| `{name}` | {_cell(shown)} | {'' if least is None else _cell(str(least))} | {_cell(meaning)} |"
            for name, shown, least, meaning in _rows(Limits)]
    out += ["", "## `OUTBOX[\"queues\"]`", "",
            "The queues' settings ([queues](../queues.md)); the limits among them may also be set per queue, in "
            "`per_queue`.", "", "| key | default | meaning |", "|---|---|---|"]
    out += [f"| `{name}` | {_cell(shown)} | {_cell(meaning)} |"
            for name, shown, _, meaning in _rows(QueueConfig, QueueLimits)]
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
