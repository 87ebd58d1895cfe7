"""Which outboxes one process harvests: entries (a table, or a tenant entry standing for the table of every
schema that has one) to {label: HarvestConfig}, the `discover()` the supervisor of many outboxes asks
(outboxes.py) at start and every rescan.

    discover = discoverer(base, {"shop": {}, "tenants": {"tenant_schemas": True}}, given_limits, locate)
    discover()   # {"shop": HarvestConfig(...), "tenants.acme": ..., "tenants.globex": ...}

Both ways of running the harvester build their engines here: `manage.py harvest` from OUTBOX["outboxes"]
(outbox/many.py: an entry names its database by Django alias) and `outbox-harvest` from its file's
`[outboxes.NAME]` tables (an entry names it by `dsn`). What differs is `locate(entry)`: the entry's
database as a DSN, and the leader name it derives for a table there. Nothing here imports Django.

Every outbox gets the base config, with what its entry sets; its leader topic and group are derived
from its database and table unless the entry names them, and its engine's name (status row, fence
session, heartbeats) is the process's name and the outbox's label: `replica-a/shop`,
`replica-a/tenants.acme`. A tenant entry's dead-letter table is the one of the tenant's schema, and
its engines write no history samples (fifty tenants' would be five statements a second at rest). An
engine listens through its database's one shared LISTEN session, which wakes it at each NOTIFY, so its
safety-net poll defaults to MANY_IDLE_POLL_INTERVAL instead of a second (unless `idle_poll_interval` is
set).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from outbox.harvest.config import TABLE_PATTERN, HarvestConfig
from outbox.harvest.sharding import shards_problem
from outbox.harvest.store import close_quietly, connect
from outbox.harvest.tenants import find_tenant_tables
from outbox.kafka.keys import boolean, key, read
from outbox.kafka.names import name_problem
from outbox.kafka.problems import Problem

#: How often several outboxes are looked for again by default (seconds): OUTBOX["discover_interval"]'s, the file's.
DISCOVER_INTERVAL = 30.0

log = logging.getLogger("outbox.harvest.outboxes")

#: The safety-net poll of an idle outbox when several share a process (seconds), unless idle_poll_interval is set.
MANY_IDLE_POLL_INTERVAL = 60.0
#: The label of the outboxes `--tenant-schemas` finds: `tenants.<schema>`.
TENANTS = "tenants"
#: An entry's database as a DSN, and the leader topic and group it derives for a table there.
Locate = Callable[[Mapping[str, Any]], tuple[str, Callable[[str], str]]]

_BASE = "OUTBOX's (the file's)"


def _schemas(value: Any) -> str | None:
    ok = isinstance(value, list | tuple) and all(isinstance(schema, str) for schema in value)
    return None if ok else f"must be a list of schema names, got {value!r}"


@dataclass(frozen=True)
class Entry:
    """What an entry may set besides its database, each key with its meaning and rule (E018); what an entry
    does not set comes from the process's settings. entry_problems() adds the checks of several keys."""

    table: str | None = key(None, "its table, optionally `schema.table`; with `tenant_schemas`, the unqualified table "
                                  "of each schema", shown=_BASE)
    leader_topic: str | None = key(None, "its leader topic (not with `tenant_schemas`: each schema's outbox derives "
                                         "its own)", shown="derived from its database and table")
    leader_group: str | None = key(None, "its leader group", shown="`leader_topic`'s default, also where "
                                                                   "`leader_topic` is set")
    shards: int | None = key(None, "its number of shards", shards_problem, code="E018", shown=_BASE)
    listen: bool | None = key(None, "LISTEN for its table's NOTIFY", shown=_BASE)
    dead_letter_topic: str | None = key(None, "also publish its parked records to this topic", shown=_BASE)
    park_after: int | None = key(None, "park its records after this many permanent failures", shown=_BASE)
    tenant_schemas: bool = key(False, "one outbox per schema that has the table, found at start and every "
                                      "`discover_interval`, labelled `<name>.<schema>`", boolean, code="E018")
    exclude_schemas: list[str] = key([], "with `tenant_schemas`: schemas to leave out", _schemas, code="E018")


def entry_problems(name: Any, entry: Any, section: type[Entry], default_table: Any) -> list[Problem]:
    """What is wrong with one entry (its keys declared by `section`, an Entry with its database's key), each
    problem naming `outboxes.<name>.<key>` (E018). The database's own check is the caller's."""
    where = f"outboxes.{name}"
    if (problem := name_problem(name)) is not None or any(c in str(name) for c in "./"):
        # `/` separates the process's name from the outbox's in an engine's name, `.` a tenant entry's schema
        return [Problem("E018", where, problem or f"must not contain '.' or '/', got {name!r}")]
    if not isinstance(entry, Mapping):
        return [Problem("E018", where, f"must be a dict, got {entry!r}")]
    known = {spec.name for spec in dataclasses.fields(section)}
    tenant, table = entry.get("tenant_schemas", False), entry.get("table", default_table)
    exclude = entry.get("exclude_schemas", [])
    kind = ("an unqualified SQL identifier (each tenant schema's table)" if tenant is True
            else "an SQL identifier, optionally schema.table")
    rules = [
        *((True, unknown, f"is not a key of an outbox (known: {', '.join(sorted(known))})")
          for unknown in sorted(set(entry) - known, key=str)),
        *((True, p.field, p.message) for p in read(section, entry)[1]),
        (not isinstance(table, str) or not TABLE_PATTERN.fullmatch(table) or (tenant is True and "." in table),
         "table", f"must be {kind}, got {table!r}"),
        (bool(exclude) and _schemas(exclude) is None and tenant is not True, "exclude_schemas",
         "applies only with tenant_schemas: True"),
        (tenant is True and bool(entry.get("leader_topic") or entry.get("leader_group")), "leader_topic",
         "cannot be set with tenant_schemas: each schema's outbox derives its own leader topic and group"),
    ]
    return [Problem("E018", f"{where}.{key}", why) for broken, key, why in rules if broken]


def outboxes_problems(raw: Any, section: type[Entry], default_table: Any,
                      database: Callable[[Mapping[str, Any]], tuple[str, str] | None], *,
                      kind: str) -> list[Problem]:
    """What is wrong with the outboxes listed (None: none are), each problem naming `outboxes.<name>.<key>` (E018):
    each entry's (entry_problems) and its database's: `database(entry)` says which key names it and why that
    cannot be (or None). `kind` is what the user wrote them as (a dict, a TOML table)."""
    if raw is None:
        return []
    if not isinstance(raw, Mapping) or not raw:
        return [Problem("E018", "outboxes", f"must be a non-empty {kind} of outbox names to {kind}s, got {raw!r}")]
    found = []
    for name, entry in raw.items():
        entry_found = entry_problems(name, entry, section, default_table)
        if isinstance(entry, Mapping) and not any(p.field == f"outboxes.{name}" for p in entry_found) \
                and (bad := database(entry)) is not None:
            entry_found.append(Problem("E018", f"outboxes.{name}.{bad[0]}", bad[1]))
        found += entry_found
    return found


def select(configured: Mapping[str, Mapping[str, Any]], names: Collection[str] | None, *, where: str,
           tenants: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The entries a process runs: those of `configured` named by `--outbox` (all when none is), plus the
    tenant entry of `--tenant-schemas` (`tenants`, labelled TENANTS), which alone replaces "all". Raises
    ValueError for a name `configured` (the setting `where` says) does not have."""
    if names:
        unknown = [name for name in names if name not in configured]
        if unknown:
            there = ", ".join(sorted(configured)) or "none"
            raise ValueError(f"--outbox: no outbox named {unknown[0]!r} in {where} (there are: {there})")
        chosen = {name: dict(configured[name]) for name in names}
    else:
        chosen = {} if tenants is not None else {name: dict(entry) for name, entry in configured.items()}
    if tenants is not None:
        chosen[TENANTS] = {"tenant_schemas": True, **tenants}
    return chosen


def outbox_config(base: HarvestConfig, label: str, entry: Mapping[str, Any], table: str, given_limits: set[str],
                  locate: Locate) -> HarvestConfig:
    """One outbox's engine config: the base's, its entry's keys, its own derived leader topic and group."""
    dsn, leader_name = locate(entry)
    derived = leader_name(table)
    limits = base.limits
    if "idle_poll_interval" not in given_limits:
        limits = dataclasses.replace(limits, idle_poll_interval=MANY_IDLE_POLL_INTERVAL)
    if entry.get("tenant_schemas"):
        limits = dataclasses.replace(limits, history_interval=0.0)  # no charts: a sample per tenant adds up
    dead_letter_table = base.dead_letter_table
    if entry.get("tenant_schemas") and dead_letter_table and "." not in dead_letter_table:
        dead_letter_table = f"{table.split('.')[0]}.{dead_letter_table}"  # the tenant's own (parking off if none)
    return dataclasses.replace(
        base, dsn=dsn, table=table, leader_topic=entry.get("leader_topic") or derived,
        leader_group=entry.get("leader_group") or derived, name=f"{base.name}/{label}",
        shards=entry.get("shards", base.shards), listen=entry.get("listen", base.listen),
        dead_letter_topic=entry.get("dead_letter_topic", base.dead_letter_topic),
        park_after=entry.get("park_after", base.park_after), dead_letter_table=dead_letter_table, limits=limits)


def discoverer(base: HarvestConfig, entries: Mapping[str, Mapping[str, Any]], given_limits: set[str],
               locate: Locate) -> Callable[[], dict[str, HarvestConfig]]:
    """The supervisor's discover(): every fixed entry's outbox, and each tenant entry's schemas as found now
    (one query per tenant entry).

    A tenant's table dropped and created again between two scans is left out of one scan: its engine,
    whose NOTIFY channel and fence name the old table's oid, stops, and the next scan starts a fresh one."""
    skipped: set[str] = set()
    oids: dict[str, int] = {}

    def discover() -> dict[str, HarvestConfig]:
        found: dict[str, HarvestConfig] = {}
        seen: dict[str, int] = {}  # this scan's oids: kept only if the whole scan succeeds
        for name, entry in entries.items():
            table = entry.get("table", base.table)
            if not entry.get("tenant_schemas"):
                found[name] = outbox_config(base, name, entry, table, given_limits, locate)
                continue
            conn = connect(locate(entry)[0], "discover", name=base.name)
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
                found[label] = outbox_config(base, label, entry, qualified, given_limits, locate)
        # A table gone, or created again, is simply new to the next scan.
        oids.clear()
        oids.update(seen)
        return found

    return discover
