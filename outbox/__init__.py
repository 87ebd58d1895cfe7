"""Transactional outbox for Django.

    from outbox import stash, stash_many

Names are loaded on first use so that `import outbox.harvest` (the engine)
never pulls in Django.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outbox.embedded import create_harvester
    from outbox.errors import InvalidRecord, OutsideTransaction
    from outbox.harvest.harvester import Harvester, State
    from outbox.stasher import stash, stash_many

__all__ = ["Harvester", "InvalidRecord", "OutsideTransaction", "State", "create_harvester", "signals", "stash",
           "stash_many"]

_LAZY = {
    "stash": "outbox.stasher",
    "stash_many": "outbox.stasher",
    "InvalidRecord": "outbox.errors",
    "OutsideTransaction": "outbox.errors",
    "create_harvester": "outbox.embedded",
    "Harvester": "outbox.harvest.harvester",
    "State": "outbox.harvest.harvester",
}


def __getattr__(name: str) -> Any:
    if name == "signals":
        return importlib.import_module("outbox.signals")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'outbox' has no attribute {name!r}")
