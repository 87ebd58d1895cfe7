"""Sphinx extension: writes reference/commands.md (MyST) from every outbox management command's argparse parser.

Each option becomes a Sphinx `option` target, so pages can link {option}`manage.py harvest --shards` and a
renamed flag breaks the build (-W -n). Runs at config-inited, before Sphinx looks for source files.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from django.core.management import get_commands, load_command_class

BASE = {"--version", "--verbosity", "--settings", "--pythonpath", "--traceback", "--no-color", "--force-color",
        "--skip-checks", "-h"}
APPS = ("outbox", "outbox.queue")


def md(text: str) -> str:
    """Plain help text as inline Markdown: every ASCII punctuation character that could be markup, escaped."""
    return re.sub(r"([\\`*_{}\[\]<>()#+!|~$&:])", r"\\\1", " ".join(text.split()))


def command_markdown(name: str) -> str:
    command = load_command_class(get_commands()[name], name)
    parser = command.create_parser("manage.py", name)
    for action in parser._actions:
        if BASE & set(action.option_strings):
            action.help = argparse.SUPPRESS
    out = [f"## `{name}`", "", f"```{{program}} manage.py {name}", "```", "", md(command.help), "",
           "```text", parser.format_usage().strip(), "```", ""]
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:
            continue
        metavar = "" if action.nargs == 0 else " " + (action.metavar or action.dest.upper())
        names = action.option_strings or [action.metavar or action.dest]
        signature = ", ".join(n + (metavar if action.option_strings else "") for n in names)
        out += [f"```{{option}} {signature}", md(action.help or "")]
        if action.choices:
            out += ["", "Choices: " + ", ".join(f"`{c}`" for c in action.choices)]
        if action.default not in (None, False, argparse.SUPPRESS) and action.nargs != 0:
            out += ["", f"Default: `{action.default}`"]
        out += ["```", ""]
    return "\n".join(out)


def write(app: Any, config: Any) -> None:
    names = sorted(n for n, app_name in get_commands().items() if app_name in APPS)
    text = "# Management commands\n\n" + "\n".join(command_markdown(n) for n in names)
    target = Path(app.srcdir) / "reference" / "commands.md"
    if not target.exists() or target.read_text() != text:  # unchanged file: no needless re-read
        target.parent.mkdir(exist_ok=True)
        target.write_text(text)


def setup(app: Any) -> dict[str, bool]:
    app.connect("config-inited", write)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
