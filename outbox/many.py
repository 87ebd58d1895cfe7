"""Several outboxes in one `manage.py harvest`: OUTBOX["outboxes"] (or `--tenant-schemas`) to the
engine's supervisor (outbox/harvest/outboxes.py), which asks `discover()` for {label: HarvestConfig}.

    OUTBOX = {
        "outboxes": {
            "shop": {},                                              # the default database's table outbox
            "billing": {"database": "billing", "shards": 4},         # another database, sharded
            "tenants": {"tenant_schemas": True, "exclude_schemas": ["public"]},   # outbox in every schema
        },
    }

Every outbox gets the settings of OUTBOX, with what its entry sets; its leader topic and group are
derived from its database and table (conf.default_leader_name) unless the entry names them, and its
engine's name (status row, fence session, heartbeats) is the process's name and the outbox's label:
`replica-a/shop`, `replica-a/tenants.acme`. A tenant entry stands for one outbox per schema holding
its (unqualified) table, found at start and every `discover_interval`; its dead-letter table is the
one of the tenant's schema.

History. A fixed entry's engine writes history samples (the dashboard's charts) every
`history_interval`, as one outbox's does; a tenant schema's does not: fifty tenants' samples would be
five statements a second at rest.

Idle cost. An outbox's engine listens through its database's one shared LISTEN session
(notify_hub.py), which wakes it at each NOTIFY and after every reconnect; so its safety-net poll,
`idle_poll_interval`, defaults to MANY_IDLE_POLL_INTERVAL here instead of a second (unless set).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from outbox import conf
from outbox.harvest.config import TABLE_PATTERN, HarvestConfig
from outbox.harvest.sharding import shards_problem
from outbox.harvest.store import close_quietly, connect
from outbox.harvest.tenants import find_tenant_tables
from outbox.kafka.keys import boolean, key, read
from outbox.kafka.names import name_problem
from outbox.kafka.problems import Problem

log = logging.getLogger("outbox.harvest.outboxes")



def _schemas(value: Any) -> str | None:
    ok = isinstance(value, list | tuple) and all(isinstance(schema, str) for schema in value)
    return None if ok else f"must be a list of schema names, got {value!r}"


_OUTBOX = "OUTBOX's"


@dataclass(frozen=True)
class OutboxEntry:
    """What an entry of OUTBOX["outboxes"] may set, each key with its meaning and rule (E018); what an entry does
    not set comes from OUTBOX itself. problems() adds the checks that need DATABASES or several keys."""

    database: str | None = key(None, "its `DATABASES` alias", shown=_OUTBOX)
    table: str | None = key(None, "its table, optionally `schema.table`; with `tenant_schemas`, the unqualified table "
                                  "of each schema", shown=_OUTBOX)
    leader_topic: str | None = key(None, "its leader topic (not with `tenant_schemas`: each schema's outbox derives "
                                         "its own)", shown="derived from its database and table")
    leader_group: str | None = key(None, "its leader group", shown="as `leader_topic`")
    shards: int | None = key(None, "its number of shards", shards_problem, code="E018", shown=_OUTBOX)
    listen: bool | None = key(None, "LISTEN for its table's NOTIFY", shown=_OUTBOX)
    dead_letter_topic: str | None = key(None, "also publish its parked records to this topic", shown=_OUTBOX)
    park_after: int | None = key(None, "park its records after this many permanent failures", shown=_OUTBOX)
    tenant_schemas: bool = key(False, "one outbox per schema that has the table, found at start and every "
                                      "`discover_interval`, labelled `<name>.<schema>`", boolean, code="E018")
    exclude_schemas: list[str] = key([], "with `tenant_schemas`: schemas to leave out", _schemas, code="E018")


#: The keys an entry of OUTBOX["outboxes"] may set.
ENTRY_KEYS = frozenset(OutboxEntry.__dataclass_fields__)
#: The safety-net poll of an idle outbox when several share a process (seconds), unless idle_poll_interval is set.
MANY_IDLE_POLL_INTERVAL = 60.0
#: The label of the outboxes `harvest --tenant-schemas` finds: `tenants.<schema>`.
TENANTS = "tenants"


def configured() -> bool:
    """Whether OUTBOX names several outboxes (OUTBOX["outboxes"])."""
    raw = conf.raw_settings()
    return isinstance(raw, dict) and bool(raw.get("outboxes"))


def problems(raw: Any) -> list[Problem]:
    """What is wrong with OUTBOX["outboxes"] (None: not set), each naming the entry and its key (E018)."""
    if raw is None:
        return []
    if not isinstance(raw, Mapping) or not raw:
        return [Problem("E018", "outboxes", f"must be a non-empty dict of outbox names to dicts, got {raw!r}")]
    found = []
    for name, entry in raw.items():
        where = f"outboxes.{name}"
        if (problem := name_problem(name)) is not None or any(c in str(name) for c in "./"):
            # `/` separates the process's name from the outbox's in an engine's name, `.` a tenant entry's schema
            found.append(Problem("E018", where, problem or f"must not contain '.' or '/', got {name!r}"))
            continue
        if not isinstance(entry, Mapping):
            found.append(Problem("E018", where, f"must be a dict, got {entry!r}"))
            continue
        for unknown in sorted(set(entry) - ENTRY_KEYS, key=str):
            found.append(Problem("E018", f"{where}.{unknown}", f"is not a key of an outbox (known: "
                                                           f"{', '.join(sorted(ENTRY_KEYS))})"))
        alias = entry.get("database", conf.OutboxKeys.database)
        if (problem := conf.alias_problem(alias)) is not None:
            found.append(Problem("E018", f"{where}.database", problem))
        found.extend(Problem(p.code, f"{where}.{p.field}", p.message) for p in read(OutboxEntry, entry)[1])
        tenant = entry.get("tenant_schemas", False)
        table = entry.get("table", conf.setting("table"))
        if not isinstance(table, str) or not TABLE_PATTERN.fullmatch(table) or (tenant is True and "." in table):
            kind = "an unqualified SQL identifier (each tenant schema's table)" if tenant is True else \
                "an SQL identifier, optionally schema.table"
            found.append(Problem("E018", f"{where}.table", f"must be {kind}, got {table!r}"))
        exclude = entry.get("exclude_schemas", [])
        if exclude and _schemas(exclude) is None and tenant is not True:
            found.append(Problem("E018", f"{where}.exclude_schemas", "applies only with tenant_schemas: True"))
        if tenant is True and (entry.get("leader_topic") or entry.get("leader_group")):
            found.append(Problem("E018", f"{where}.leader_topic", "cannot be set with tenant_schemas: each schema's "
                                                                  "outbox derives its own leader topic and group"))
    return found


def selected_entries(names: list[str] | None, *, tenant_schemas: bool = False,
                     table: str | None = None, database: str | None = None,
                     exclude_schemas: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """The entries `harvest` runs: those of OUTBOX["outboxes"] named by `--outbox` (all when none is),
    plus, with `--tenant-schemas`, one for `table` in every schema. Raises ValueError naming the problem."""
    raw = conf.raw_settings()
    configured_entries = dict(raw.get("outboxes") or {}) if isinstance(raw, dict) else {}
    if names:
        unknown = [name for name in names if name not in configured_entries]
        if unknown:
            known = ", ".join(sorted(configured_entries)) or "none"
            raise ValueError(f"--outbox: no outbox named {unknown[0]!r} in OUTBOX['outboxes'] (there are: {known})")
        chosen = {name: dict(configured_entries[name]) for name in names}
    else:
        chosen = {} if tenant_schemas else {name: dict(entry) for name, entry in configured_entries.items()}
    if tenant_schemas:
        entry: dict[str, Any] = {"tenant_schemas": True}
        if table is not None:
            entry["table"] = table
        if database is not None:
            entry["database"] = database
        if exclude_schemas:
            entry["exclude_schemas"] = list(exclude_schemas)
        chosen[TENANTS] = entry
    found = problems({name: entry for name, entry in chosen.items()}) if chosen else []
    if found:
        raise ValueError("; ".join(f"{p.field}: {p.message}" for p in found))
    return chosen


def outbox_config(base: HarvestConfig, label: str, entry: Mapping[str, Any], table: str,
                  given_limits: set[str]) -> HarvestConfig:
    """One outbox's engine config: OUTBOX's (`base`), its entry's keys, its own derived leader topic and group."""
    alias = entry.get("database", conf.database_alias())
    derived = conf.default_leader_name(alias, table)
    limits = base.limits
    if "idle_poll_interval" not in given_limits:
        limits = dataclasses.replace(limits, idle_poll_interval=MANY_IDLE_POLL_INTERVAL)
    if entry.get("tenant_schemas"):
        limits = dataclasses.replace(limits, history_interval=0.0)  # no charts: a sample per tenant adds up
    dead_letter_table = base.dead_letter_table
    if entry.get("tenant_schemas") and dead_letter_table and "." not in dead_letter_table:
        dead_letter_table = f"{table.split('.')[0]}.{dead_letter_table}"  # the tenant's own (parking off if none)
    return dataclasses.replace(
        base, dsn=conf.dsn_for(alias), table=table, leader_topic=entry.get("leader_topic") or derived,
        leader_group=entry.get("leader_group") or derived, name=f"{base.name}/{label}",
        shards=entry.get("shards", base.shards), listen=entry.get("listen", base.listen),
        dead_letter_topic=entry.get("dead_letter_topic", base.dead_letter_topic),
        park_after=entry.get("park_after", base.park_after), dead_letter_table=dead_letter_table, limits=limits)


def discoverer(base: HarvestConfig, entries: Mapping[str, Mapping[str, Any]],
               given_limits: set[str]) -> Callable[[], dict[str, HarvestConfig]]:
    """The supervisor's discover(): every fixed entry's outbox, and each tenant entry's schemas as found now
    (one query per tenant entry).

    A tenant's table dropped and created again between two scans is left out of one scan: its engine,
    whose NOTIFY channel and fence name the old table's oid, stops, and the next scan starts a fresh one."""
    skipped: set[str] = set()
    oids: dict[str, int] = {}
    default_table = base.table

    def discover() -> dict[str, HarvestConfig]:
        found: dict[str, HarvestConfig] = {}
        seen: dict[str, int] = {}  # this scan's oids: kept only if the whole scan succeeds
        for name, entry in entries.items():
            table = entry.get("table", default_table)
            if not entry.get("tenant_schemas"):
                found[name] = outbox_config(base, name, entry, table, given_limits)
                continue
            alias = entry.get("database", conf.database_alias())
            conn = connect(conf.dsn_for(alias), "discover", name=base.name)
            try:
                tables = find_tenant_tables(conn, table.rpartition(".")[2], exclude=entry.get("exclude_schemas", ()),
                                            skipped=skipped)
            finally:
                close_quietly(conn)
            for qualified, oid in tables.items():
                label = f"{name}.{qualified.split('.')[0]}"
                if oids.get(label, oid) != oid:
                    log.info("Outbox %s: table %s was created again: its engine starts afresh", label, qualified)
                    continue  # left out of this scan (its old engine stops), found afresh by the next
                seen[label] = oid
                found[label] = outbox_config(base, label, entry, qualified, given_limits)
        # A table gone, or created again, is simply new to the next scan.
        oids.clear()
        oids.update(seen)
        return found

    return discover
