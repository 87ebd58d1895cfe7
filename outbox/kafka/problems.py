"""A configuration problem, as every check of the outbox reports it: a stable code, the setting, and why."""

from __future__ import annotations

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
