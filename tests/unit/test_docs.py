"""The README's configuration reference lists every setting, and each limit with its real default."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from outbox import conf
from outbox.harvest.config import Limits

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def table_rows(heading: str) -> dict[str, str]:
    """`name` -> default cell of the first table whose header row starts with `heading`."""
    start = README.index(f"| {heading} | default | meaning |")
    rows = {}
    for line in README[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        name, default = (cell.strip() for cell in line.split("|")[1:3])
        rows[name.strip("`")] = default.strip("`")
    return rows


def test_every_setting_is_documented() -> None:
    documented = set(table_rows("key")) | set(table_rows("limit"))
    assert conf.known_keys() - documented == set(), "settings missing from the README"
    assert documented - conf.known_keys() == set(), "the README documents settings that do not exist"


def test_each_limit_is_documented_with_its_default() -> None:
    rows = table_rows("limit")
    for spec in dataclasses.fields(Limits):
        if spec.default is None:
            continue  # derived from other limits, documented as a formula
        assert re.fullmatch(r"[\d.]+", rows[spec.name]), f"{spec.name}: {rows[spec.name]!r}"
        assert float(rows[spec.name]) == spec.default, f"{spec.name}: README {rows[spec.name]}, code {spec.default}"
