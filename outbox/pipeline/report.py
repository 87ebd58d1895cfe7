"""report.json, the human summary and the exit code, from `audit.Findings` (plain Python, no Spark).

The top level always has `messages`, `distinct_ids`, `duplicates`, `reversals`, `missing` and
`latency_ms` (`p50`, `p95`, `p99`); the rest (`without_headers`, `topics`, `examples`, `ledger`,
`run`) is detail. Exit status 1 means reversals or missing ids, which at-least-once delivery never
excuses; duplicates and messages without headers are reported but do not fail the audit.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # plain Python: the report needs no pyspark
    from outbox.pipeline.audit import Findings

COUNTERS = ("messages", "distinct_ids", "duplicates", "reversals", "without_headers")
EXIT_OK, EXIT_VIOLATIONS, EXIT_USAGE = 0, 1, 2
REPORT_NAME = "report.json"


def build(findings: Findings, topics: Sequence[str], *, ledger: str | None = None,
          run: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The report as a JSON-ready dict; every audited topic appears, even an empty one."""
    per_topic: dict[str, dict[str, Any]] = {}
    for topic in topics:
        found = findings.topics.get(topic, {})
        per_topic[topic] = {name: int(found.get(name) or 0) for name in COUNTERS}
        per_topic[topic]["latency_ms"] = found.get("latency_ms") or {"p50": None, "p95": None, "p99": None}
    totals = {name: sum(detail[name] for detail in per_topic.values()) for name in COUNTERS}
    return {
        "messages": totals["messages"],
        "distinct_ids": totals["distinct_ids"],
        "duplicates": totals["duplicates"],
        "reversals": totals["reversals"],
        "missing": int(findings.missing),
        "latency_ms": dict(findings.latency_ms),
        "without_headers": totals["without_headers"],
        "topics": per_topic,
        "ledger": None if ledger is None else {"source": ledger, "ids": findings.ledger_ids},
        "examples": {**{kind: list(items) for kind, items in findings.examples.items()},
                     "missing": list(findings.missing_examples)},
        "run": dict(run or {}),
    }


def exit_code(report: Mapping[str, Any]) -> int:
    return EXIT_VIOLATIONS if report["reversals"] or report["missing"] else EXIT_OK


def write(report: Mapping[str, Any], out_dir: str | os.PathLike[str]) -> Path:
    """Write `out_dir/report.json` atomically (a reader never sees half a report)."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / REPORT_NAME
    with tempfile.NamedTemporaryFile("w", dir=folder, prefix=".report-", suffix=".json", delete=False) as out:
        json.dump(report, out, indent=2, sort_keys=False)
        out.write("\n")
    os.replace(out.name, target)
    return target


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def summary(report: Mapping[str, Any], path: Path | str | None = None) -> str:
    """A few lines for a person: totals, one line per topic, the verdict."""
    latency = report["latency_ms"]
    ledger = report.get("ledger")
    lines = [
        f"outbox audit: {len(report['topics'])} topic(s), {report['messages']:,} messages, "
        f"{report['distinct_ids']:,} distinct ids",
        f"  duplicates       {report['duplicates']:>12,}  (allowed: delivery is at least once)",
        f"  reversals        {report['reversals']:>12,}",
        f"  missing          {report['missing']:>12,}  "
        + (f"(ledger {ledger['source']}: {ledger['ids'] or 0:,} ids)" if ledger else "(no ledger given)"),
        f"  without headers  {report['without_headers']:>12,}",
        f"  latency ms       p50 {_ms(latency['p50'])}  p95 {_ms(latency['p95'])}  p99 {_ms(latency['p99'])}",
    ]
    for topic, detail in report["topics"].items():
        lines.append(f"  {topic}: {detail['messages']:,} messages, {detail['distinct_ids']:,} ids, "
                     f"{detail['duplicates']:,} duplicates, {detail['reversals']:,} reversals, "
                     f"{detail['without_headers']:,} without headers")
    for example in report["examples"].get("reversals", [])[:3]:
        lines.append(f"  reversal: {example['topic']}[{example['partition']}]@{example['offset']} key "
                     f"{example['key']!r}: id {example['outbox_id']} after id {example['after']['outbox_id']}"
                     + ("" if example["after"].get("offset") is None else f" (offset {example['after']['offset']})"))
    if report["examples"].get("missing"):
        shown = ", ".join(str(i) for i in report["examples"]["missing"][:5])
        lines.append(f"  missing ids: {shown}{', ...' if report['missing'] > 5 else ''}")
    if exit_code(report) == EXIT_OK:
        lines.append("result: OK")
    else:
        lines.append(f"result: FAILED ({report['reversals']:,} reversals, {report['missing']:,} missing)")
    if path is not None:
        lines.append(f"report: {path}")
    return "\n".join(lines)
