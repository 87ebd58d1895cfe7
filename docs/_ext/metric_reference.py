"""Sphinx extension: writes reference/metrics.md from the exporters' source (outbox/metrics.py and
outbox/queue/metrics.py): every metric each one defines, its type, labels and help text, read from the calls that
define them, so a metric added in code is in the reference at the next build. A helper that builds names
(`counter("sent", ...)` making `outbox_queue_messages_sent`) is followed to the f-string it fills in."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXPORTERS = {"The harvester (`harvest --metrics-port`)": ROOT / "outbox" / "metrics.py",
             "The queues (`outbox_consume` and `outbox_redeliver --metrics-port`)":
                 ROOT / "outbox" / "queue" / "metrics.py"}
KINDS = {"Counter": "counter", "CounterMetricFamily": "counter", "Gauge": "gauge", "GaugeMetricFamily": "gauge",
         "Histogram": "histogram"}


def _text(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _labels(call: ast.Call, names: dict[str, list[str]]) -> list[str]:
    found = next((k.value for k in call.keywords if k.arg == "labels"), call.args[2] if len(call.args) > 2 else None)
    if isinstance(found, ast.List | ast.Tuple):
        labels: list[str] = []
        for element in found.elts:
            if isinstance(element, ast.Starred) and isinstance(element.value, ast.Name):
                labels += names.get(element.value.id, [])
            elif (text := _text(element)) is not None:
                labels.append(text)
        return labels
    if isinstance(found, ast.Name):
        return names.get(found.id, [found.id])
    return []


def metrics(path: Path) -> list[tuple[str, str, list[str], str]]:
    tree = ast.parse(path.read_text())
    names: dict[str, list[str]] = {}  # module- and function-level lists of label names (`per_engine = [...]`)
    helpers: dict[str, tuple[str, ast.Call]] = {}  # def counter(name, text): return Counter(f"prefix_{name}", ...)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            names[node.targets[0].id] = [t for e in node.value.elts if (t := _text(e)) is not None]
        if isinstance(node, ast.FunctionDef) and len(node.body) == 1 and isinstance(node.body[0], ast.Return) \
                and isinstance(call := node.body[0].value, ast.Call) and isinstance(call.func, ast.Name) \
                and call.func.id in KINDS and isinstance(call.args[0], ast.JoinedStr):
            helpers[node.name] = (node.args.args[0].arg, call)
    # def family(kind, metric, text, value): found = kind(metric, text, labels=...): called with the kind and name
    families = {node.name: call for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.args.args
                for call in ast.walk(node) if isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                and call.func.id == node.args.args[0].arg}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or not node.args:
            continue
        if node.func.id in KINDS and (name := _text(node.args[0])) is not None:
            found.append((name, KINDS[node.func.id], _labels(node, names), _text(node.args[1]) or ""))
        elif node.func.id in families and isinstance(node.args[0], ast.Name) and node.args[0].id in KINDS \
                and (name := _text(node.args[1])) is not None:
            labels = _labels(families[node.func.id], names)
            found.append((name, KINDS[node.args[0].id], labels, _text(node.args[2]) or ""))
        elif node.func.id in helpers and (part := _text(node.args[0])) is not None:
            parameter, call = helpers[node.func.id]
            name = "".join(_text(v) or (part if isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Name)
                                        and v.value.id == parameter else "{?}") for v in call.args[0].values)
            found.append((name, KINDS[call.func.id], _labels(call, names), _text(node.args[1]) or ""))
    unique = {}
    for name, kind, labels, text in found:
        unique.setdefault(name, (name, kind, labels, text))
    return sorted(unique.values())


def write(app: Any, config: Any) -> None:
    lines = ["# Metrics", "", "What each process exports for Prometheus, read from the exporters' code at every "
             "build. A counter's samples carry Prometheus's `_total` suffix; a histogram's its `_bucket`, `_sum` "
             "and `_count`.",
             ""]
    for title, path in EXPORTERS.items():
        lines += [f"## {title}", "", "| metric | type | labels | meaning |", "| --- | --- | --- | --- |"]
        for name, kind, labels, text in metrics(path):
            shown = ", ".join(f"`{label}`" for label in labels) or "none"
            lines.append(f"| `{name}` | {kind} | {shown} | {text.replace('|', chr(92) + '|')} |")
        lines.append("")
    target = Path(app.srcdir) / "reference" / "metrics.md"
    text = "\n".join(lines)
    if not target.exists() or target.read_text() != text:
        target.write_text(text)


def setup(app: Any) -> dict[str, bool]:
    app.connect("config-inited", write)
    return {"parallel_read_safe": True}
