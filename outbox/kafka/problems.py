"""A configuration problem, as every check of the outbox reports it: a stable code, the setting, and why."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One configuration problem: a stable code, the setting it concerns, and why."""

    code: str
    field: str
    message: str

    def __str__(self) -> str:
        # A setting's name comes from the user's mapping: one with a newline must not make two lines.
        field = self.field if self.field.isprintable() else repr(self.field)
        return f"{field}: {self.message}"


def unknown_keys(given: Iterable[object], known: Iterable[str], where: str = "") -> list[Problem]:
    """E002 for each key of `given` that is not `known`, with the closest known key as a "did you mean";
    `where` prefixes the setting's name (a nested mapping's path)."""
    known = sorted(known)
    found = []
    for key in sorted(set(given) - set(known), key=str):
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        found.append(Problem("E002", f"{where}{key}", f"is not a known setting{hint}"))
    return found
