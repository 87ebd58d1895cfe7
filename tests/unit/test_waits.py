"""The unit run waits on conditions, never on the clock: no test in tests/unit sleeps.

A fixed sleep either waits longer than what it waits for or, on a loaded machine, not long enough; a test
that proves something does not happen waits for progress that would have shown it instead
(tests/support/waiting.py says how).
"""

from __future__ import annotations

import ast
from pathlib import Path

UNIT = Path(__file__).resolve().parent


def sleeps(source: str) -> list[int]:
    """Lines of `source` that call a sleep (time.sleep, asyncio.sleep, a bare sleep) or wait on a fresh Event."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        fresh_event = (isinstance(func, ast.Attribute) and func.attr == "wait" and isinstance(func.value, ast.Call)
                       and getattr(func.value.func, "attr", getattr(func.value.func, "id", "")) == "Event")
        if name == "sleep" or fresh_event:
            found.append(node.lineno)
    return found


def test_the_check_finds_each_kind_of_sleep():
    assert sleeps("import time\ntime.sleep(0.1)\n") == [2]
    assert sleeps("from time import sleep\nsleep(1)\n") == [2]
    assert sleeps("async def f():\n    await asyncio.sleep(0)\n") == [2]
    assert sleeps("threading.Event().wait(0.3)\n") == [1]
    assert sleeps("gate.wait(5)\nwait_until(lambda: True, 5, 'x')\n") == []


def test_no_unit_test_sleeps():
    offenders = [f"{path.relative_to(UNIT.parents[1])}:{line}"
                 for path in sorted(UNIT.rglob("*.py")) for line in sleeps(path.read_text())]
    assert offenders == [], "wait on a condition (tests/support/waiting.py), not the clock: " + ", ".join(offenders)
