"""Every test marked `slow` says why in its docstring (a sentence starting "Slow:"), or its module's does when
the whole module is marked: what it waits for, so that whoever wants the suite faster knows where the minutes go
and a test that became slow by accident stands out. The slow ones still run in CI."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _marks_slow(node: ast.expr) -> bool:
    """Whether `node` is `pytest.mark.slow` (or a list/tuple holding it)."""
    if isinstance(node, ast.List | ast.Tuple):
        return any(_marks_slow(element) for element in node.elts)
    return isinstance(node, ast.Attribute) and node.attr == "slow" and isinstance(node.value, ast.Attribute) \
        and node.value.attr == "mark"


def unexplained(source: str) -> list[str]:
    """The slow tests of `source` (a test module) whose docstring, or whose module's, has no "Slow:" sentence."""
    tree = ast.parse(source)
    module_slow = any(isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
                      and _marks_slow(node.value) for node in tree.body)
    module_says = "Slow:" in (ast.get_docstring(tree) or "")
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or not node.name.startswith("test_"):
            continue
        if "Slow:" in (ast.get_docstring(node) or ""):
            continue
        if any(_marks_slow(decorator) for decorator in node.decorator_list) or (module_slow and not module_says):
            found.append(node.name)
    return found


def test_the_check_finds_a_slow_test_that_does_not_say_why():
    assert unexplained("import pytest\n@pytest.mark.slow\ndef test_a():\n    pass\n") == ["test_a"]
    assert unexplained('@pytest.mark.slow\ndef test_a():\n    """Slow: a broker restarts."""\n') == []
    assert unexplained("pytestmark = [pytest.mark.integration, pytest.mark.slow]\ndef test_a():\n    pass\n") \
        == ["test_a"]
    assert unexplained('"""Slow: three brokers."""\npytestmark = [pytest.mark.slow]\ndef test_a():\n    pass\n') == []
    assert unexplained("@pytest.mark.serial\ndef test_a():\n    pass\n") == []


def test_every_slow_test_says_why():
    offenders = [f"{path.relative_to(TESTS.parent)}::{name}" for path in sorted(TESTS.rglob("test_*.py"))
                 for name in unexplained(path.read_text())]
    assert offenders == [], "say why in the docstring, in a sentence starting 'Slow:': " + ", ".join(offenders)
