"""Several outboxes in one `manage.py harvest`: OUTBOX["outboxes"] (or `--tenant-schemas`) to the
engine's supervisor (outbox/harvest/outboxes.py), which asks `discover()` for {label: HarvestConfig}.

    OUTBOX = {
        "outboxes": {
            "shop": {},                                              # the default database's table outbox
            "billing": {"database": "billing", "shards": 4},         # another database, sharded
            "tenants": {"tenant_schemas": True, "exclude_schemas": ["public"]},   # outbox in every schema
        },
    }

What this module adds to the engine's discovery (outbox/harvest/discovery.py, shared with `outbox-harvest`) is
Django's side: an entry names its database by `DATABASES` alias, its leader topic and group are derived from that
database's settings (conf.default_leader_name), and a table an entry does not set is OUTBOX's. Each outbox's
config, labels, history and idle poll are discovery's (its docstring says what each outbox gets).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from outbox import conf
from outbox.harvest import discovery
from outbox.harvest.config import HarvestConfig
from outbox.kafka.keys import key
from outbox.kafka.problems import Problem

#: Where several outboxes are listed, as `harvest`'s flags and errors name it.
OUTBOXES = "OUTBOX['outboxes']"
#: Re-exported: what `harvest --tenant-schemas` labels its outboxes, and their idle poll.
TENANTS, MANY_IDLE_POLL_INTERVAL = discovery.TENANTS, discovery.MANY_IDLE_POLL_INTERVAL


@dataclass(frozen=True)
class OutboxEntry(discovery.Entry):
    """What an entry of OUTBOX["outboxes"] may set: its database by alias, and discovery.Entry's keys (E018);
    what an entry does not set comes from OUTBOX itself. problems() adds the checks that need DATABASES."""

    database: str | None = key(None, "its `DATABASES` alias", shown="OUTBOX's")


#: The keys an entry of OUTBOX["outboxes"] may set.
ENTRY_KEYS = frozenset(OutboxEntry.__dataclass_fields__)


def configured() -> bool:
    """Whether OUTBOX names several outboxes (OUTBOX["outboxes"])."""
    raw = conf.raw_settings()
    return isinstance(raw, dict) and bool(raw.get("outboxes"))


def database_aliases() -> list[str]:
    """The `DATABASES` aliases whose status tables hold this project's engines' rows: OUTBOX's, then each other one
    an OUTBOX["outboxes"] entry names (an engine writes its status row in its own outbox's database)."""
    aliases = [conf.database_alias()]
    places = {conf.database_place(aliases[0])}
    entries = conf.raw_settings().get("outboxes") if configured() else None
    for entry in entries.values() if isinstance(entries, Mapping) else ():
        alias = entry.get("database", aliases[0]) if isinstance(entry, Mapping) else aliases[0]
        # Only a PostgreSQL entry of DATABASES (check says what is wrong with another), and each database once,
        # however many aliases name it.
        if alias not in aliases and conf.alias_problem(alias) is None and conf.database_place(alias) not in places:
            aliases.append(alias)
            places.add(conf.database_place(alias))
    return aliases


def problems(raw: Any) -> list[Problem]:
    """What is wrong with OUTBOX["outboxes"] (None: not set), each naming the entry and its key (E018)."""
    def database(entry: Mapping[str, Any]) -> tuple[str, str] | None:
        why = conf.alias_problem(entry.get("database", conf.OutboxKeys.database))
        return None if why is None else ("database", why)

    return discovery.outboxes_problems(raw, OutboxEntry, conf.setting("table"), database, kind="dict")


def selected_entries(names: list[str] | None, *, tenant_schemas: bool = False,
                     table: str | None = None, database: str | None = None,
                     exclude_schemas: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """The entries `harvest` runs: those of OUTBOX["outboxes"] named by `--outbox` (all when none is),
    plus, with `--tenant-schemas`, one for `table` in every schema. Raises ValueError naming the problem."""
    raw = conf.raw_settings()
    tenants = {name: value for name, value in (("table", table), ("database", database)) if value is not None}
    if exclude_schemas:
        tenants["exclude_schemas"] = list(exclude_schemas)
    chosen = discovery.select(dict(raw.get("outboxes") or {}) if isinstance(raw, dict) else {}, names,
                              where=OUTBOXES, tenants=tenants if tenant_schemas else None)
    if found := problems(chosen) if chosen else []:
        raise ValueError("; ".join(f"{p.field}: {p.message}" for p in found))
    return chosen


def locate(entry: Mapping[str, Any]) -> tuple[str, Callable[[str], str]]:
    """An entry's database by its alias (OUTBOX's when it names none): its DSN and derived leader names."""
    alias = entry.get("database", conf.database_alias())
    return conf.dsn_for(alias), functools.partial(conf.default_leader_name, alias)


def discoverer(base: HarvestConfig, entries: Mapping[str, Mapping[str, Any]],
               given_limits: set[str]) -> Callable[[], dict[str, HarvestConfig]]:
    """The supervisor's discover() (discovery.discoverer), each entry's database by Django alias."""
    return discovery.discoverer(base, entries, given_limits, locate)
