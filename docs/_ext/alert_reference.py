"""Sphinx extension: writes reference/alerts.md from the alert rules (monitoring/prometheus/outbox-alerts.yml): each
alert, its severity, what it says and a link to its runbook_url, so the build (-W) fails on a stale anchor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

RULES = Path(__file__).resolve().parents[2] / "monitoring" / "prometheus" / "outbox-alerts.yml"


def write(app: Any, config: Any) -> None:
    lines = ["# Alerts", "", "The Prometheus rules in `monitoring/prometheus/outbox-alerts.yml`, written from them.",
             "", "| alert | severity | says | for | runbook |", "| --- | --- | --- | --- | --- |"]
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                # docs/operations.md#x, from reference/: ../operations.md#x
                url = rule["annotations"]["runbook_url"].removeprefix("docs/")
                summary = rule["annotations"]["description"].replace("|", "\\|")
                lines.append(f"| `{rule['alert']}` | {rule['labels']['severity']} | {summary} | "
                             f"{rule.get('for', 'at once')} | [runbook](../{url}) |")
    target = Path(app.srcdir) / "reference" / "alerts.md"
    text = "\n".join(lines) + "\n"
    if not target.exists() or target.read_text() != text:
        target.write_text(text)


def setup(app: Any) -> dict[str, bool]:
    app.connect("config-inited", write)
    return {"parallel_read_safe": True}
