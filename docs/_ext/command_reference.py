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
    return parser_markdown(f"## `{name}`", f"manage.py {name}", command.help, parser)


def standalone_markdown() -> str:
    """`outbox-harvest` and each of its commands (outbox/harvest/cli.py)."""
    from outbox.harvest.cli import parser

    top = parser()
    [commands] = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {choice.dest: choice.help for choice in commands._choices_actions}
    out = ["# The stand-alone harvester", "", md(top.description or "") + " Without a command, it runs: "
           "`outbox-harvest --shards 4` is `outbox-harvest run --shards 4` ([how-to](../standalone.md)).", ""]
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if action.option_strings == ["-h", "--help"]:
                action.help = argparse.SUPPRESS
        out.append(parser_markdown(f"## `outbox-harvest {name}`", f"outbox-harvest {name}", helps[name] or "", sub))
    return "\n".join([*out, file_keys_markdown()])


def file_keys_markdown() -> str:
    """What `--config FILE.toml` takes (cli.FILE_KEYS), and which of OUTBOX's keys it does not."""
    from outbox.conf import OutboxKeys
    from outbox.harvest.cli import FILE_KEYS
    from outbox.harvest.config import LIMIT_NAMES, SETTING_KEYS

    def keys(names: Any) -> str:
        return ", ".join(f"`{name}`" for name in names)

    others = [name for name in OutboxKeys.__dataclass_fields__ if name not in FILE_KEYS]
    return "\n".join([
        "## The file's keys", "",
        "`--config FILE.toml` takes these keys, with the meanings of the [settings reference](settings.md) "
        "(`base_kafka_config` and `producer_kafka_config` as tables of librdkafka properties); any other is "
        "refused (`outbox.E002`, with a \"did you mean\"):", "",
        "- the database: `dsn` (else `DATABASE_URL`);",
        f"- the engine's keys: {keys(SETTING_KEYS)};",
        f"- its limits: {keys(LIMIT_NAMES)};",
        "- several outboxes: `outboxes` (`[outboxes.NAME]` tables, each with an entry's keys and `dsn` in place of "
        "`database`) and `discover_interval`.", "",
        f"`OUTBOX`'s keys for the Django side ({keys(others)}) are not the harvester's, and not read here. TOML has "
        "no null, so a setting's `None` (no status rows, parked records kept until an operator acts) cannot be "
        "written in the file: leave the key out for its default.", ""])


def parser_markdown(title: str, program: str, summary: str, parser: argparse.ArgumentParser) -> str:
    out = [title, "", f"```{{program}} {program}", "```", "", md(summary), "",
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
    commands = "# Management commands\n\n" + "\n".join(command_markdown(n) for n in names)
    for target, text in ((Path(app.srcdir) / "reference" / "commands.md", commands),
                         (Path(app.srcdir) / "reference" / "standalone.md", standalone_markdown())):
        if not target.exists() or target.read_text() != text:  # unchanged file: no needless re-read
            target.parent.mkdir(exist_ok=True)
            target.write_text(text)


def setup(app: Any) -> dict[str, bool]:
    app.connect("config-inited", write)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
