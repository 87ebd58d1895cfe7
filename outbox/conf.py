"""Django settings (`OUTBOX = {...}` and the environment) to the engine's one frozen config, and OUTBOX read once.

`current()` is OUTBOX as read once (again when Django's setting_changed says it changed): OutboxKeys holds the
keys that belong to Django (which database, stash()'s limits, the console's thresholds, tracing, ...), each
declared once with its default, meaning and rule. The engine's keys and limits are declared by HarvestConfig and
Limits themselves (harvest/config.py), OUTBOX["queues"] by the queue app (queue/app_settings.py), OUTBOX["outboxes"]
by many.py, OUTBOX["cloudevents"] by cloudevents.py; settings_problems.py gathers what each finds wrong, and every
key unknown to all of them is a system-check error, not a silent default.

`database` means the same everywhere: stash() writes there by default, the admin and health probe
read there, the harvester harvests there. `table` is the harvester's: stash() and the admin always
use the model's table (`outbox`), and a check warns when the two differ.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.apps import apps
from django.conf import settings
from django.core.signals import setting_changed
from django.db import connections
from django.dispatch import receiver
from psycopg.conninfo import make_conninfo

from outbox.harvest.config import LIMIT_NAMES, SETTING_KEYS, HarvestConfig, from_values, leader_name
from outbox.harvest.discovery import DISCOVER_INTERVAL
from outbox.kafka import redaction
from outbox.kafka.keys import boolean, bootstrap, key, positive_int, positive_seconds, read, seconds
from outbox.kafka.problems import Problem


def _paths(value: Any) -> str | None:
    ok = value is None or isinstance(value, str) or (isinstance(value, list | tuple)
                                                     and all(isinstance(item, str) for item in value))
    return None if ok else f"must be a path or a list of paths, got {value!r}"


@dataclass(frozen=True)
class OutboxKeys:
    """OUTBOX's keys that belong to the Django side, each with its default, its line in the settings reference, and
    its rule (the engine's keys are HarvestConfig's, its limits Limits'). `cloudevents` and `outboxes` are checked by
    their own modules, a `database` that is a string against DATABASES (settings_problems.py): one that is not keeps
    the default, so what reads it meanwhile (the console, stash()) works."""

    database: str = key("default", "`DATABASES` alias of the outbox: the harvester connects to it (with its own "
                                   "connections), the admin reads it",
                        lambda alias: None if isinstance(alias, str) else alias_problem(alias), code="E011")
    max_value_bytes: int = key(900_000, "stash()'s limit on a value's UTF-8 size", positive_int)
    max_header_bytes: int = key(64 * 1024, "stash()'s limit on all of a record's headers", positive_int)
    status_gone_after: float = key(20.0, "the dashboard and `harvest_health` call a replica not seen for this long "
                                         "gone", positive_seconds)
    stuck_after: float = key(300.0, "records waiting or in flight longer than this (since written) are stuck",
                             positive_seconds)
    stuck_reset_count: int = key(3, "... and records whose delivery failed this often", positive_int)
    horizon_warn_after: float = key(60.0, "the dashboard, `harvest_health` and `outbox_horizon_age_seconds` say who "
                                          "holds the database's horizon back (a transaction left open, a report) once "
                                          "it has for this long; the harvester does not wait for it, but the outbox's "
                                          "dead rows pile up", positive_seconds)
    tracing: bool = key(True, "OpenTelemetry trace context at `stash()`/`send()` and spans in the harvester and "
                              "queue consumers, when `opentelemetry-api` is installed (the `[otel]` extra); `False`: "
                              "nothing is added and nothing of OpenTelemetry imported: "
                              "[docs/tracing.md](../tracing.md)", boolean, code="E015")
    cloudevents: Mapping[str, Any] | None = key(
        None, "publish these topics' records as CloudEvents in Kafka's binary mode: `{\"source\": \"/shop\", "
              "\"types\": {\"orders\": \"com.example.shop.order\"}, \"content_type\": \"application/json\"}` "
              "(`stash(..., cloudevent=...)` per call): [docs/tracing.md](../tracing.md#cloudevents)")
    outboxes: Mapping[str, Any] | None = key(
        None, "several outboxes in one `harvest` process, each with its own leader group (or shards), fence and "
              "status row: `{\"shop\": {}, \"billing\": {\"database\": \"billing\", \"shards\": 4}, "
              "\"tenants\": {\"tenant_schemas\": True, \"exclude_schemas\": [\"public\"]}}`; what an entry may set "
              "is below: [docs/scaling.md](../scaling.md#many-outboxes-in-one-process)")
    discover_interval: float = key(DISCOVER_INTERVAL, "how often those outboxes are looked for again: a tenant "
                                                      "schema created meanwhile gets harvested, a dropped one's engine "
                                                      "stops", positive_seconds)
    tests_require_atomic: bool = key(True, "under Django's `TestCase` and pytest-django's `db`, `stash()` outside an "
                                           "`atomic()` of the code's own raises `OutsideTransaction`, as in "
                                           "production; `False` lets the test's own transaction count: "
                                           "[docs/testing.md](../testing.md)", boolean)
    spark_jars: str | list[str] | None = key(None, "`outbox_audit`'s Kafka connector jars (else "
                                                   "`$OUTBOX_SPARK_JARS`, else what `bin/services up` fetched): "
                                                   "[docs/audit.md](../audit.md)", _paths)


#: Keys of the apps beside this one, known when that app is installed (its own checks read them), with their meaning.
APP_KEYS = {"queues": ("outbox.queue", "message queues: [docs/queues.md](../queues.md)")}
#: Settings that did something once and do nothing now: accepted, with a warning saying so.
RETIRED_KEYS: dict[str, str] = {
    "rescan_interval": "marks look up the ids that were not visible yet by key; nothing re-reads the table from "
                       "its head any more",
}
# Keys of a Django DATABASES OPTIONS dict that configure Django or psycopg objects, not libpq.
_NON_LIBPQ_OPTIONS = {"pool", "isolation_level", "server_side_binding", "assume_role", "cursor_factory", "context"}
_OWN_KEYS = frozenset(OutboxKeys.__dataclass_fields__)


@dataclass(frozen=True)
class Settings:
    """OUTBOX as read: as written (`raw`, {} when it is not a dict), the Django side's keys with their defaults (a key
    in breach of its rule keeps its default), and what was wrong with it (E001, or the keys' rules)."""

    raw: Mapping[str, Any]
    keys: OutboxKeys
    problems: tuple[Problem, ...]
    #: OUTBOX["cloudevents"] when it is a dict, else {} (stash() asks for every record).
    cloudevents: Mapping[str, Any]


_current: Settings | None = None


def current() -> Settings:
    """OUTBOX as read once, and again after Django's setting_changed (override_settings, pytest-django's `settings`):
    stash() reads it for every record, so it must not touch django.conf.settings each time (a third of a
    microsecond an attribute)."""
    global _current
    if _current is None:
        value = getattr(settings, "OUTBOX", {})
        if not isinstance(value, Mapping):
            problem = Problem("E001", "OUTBOX", f"must be a dict, got {type(value).__name__}")
            _current = Settings({}, OutboxKeys(), (problem,), {})
        else:
            keys, found = read(OutboxKeys, value)
            events = keys.cloudevents if isinstance(keys.cloudevents, Mapping) else {}
            _current = Settings(dict(value), keys, tuple(found), events)
    return _current


@receiver(setting_changed)
def _settings_changed(setting: str, **kwargs: Any) -> None:
    global _current
    if setting == "OUTBOX":
        _current = None


def known_keys() -> frozenset[str]:
    installed = frozenset(key for key, (app, _) in APP_KEYS.items() if apps.is_installed(app))
    return _OWN_KEYS | frozenset(SETTING_KEYS) | frozenset(LIMIT_NAMES) | installed | frozenset(RETIRED_KEYS)


def raw_settings() -> Mapping[str, Any]:
    return current().raw


def setting(name: str) -> Any:
    """One OUTBOX value with its default (durations in seconds)."""
    read_once = current()
    if name in _OWN_KEYS:
        return getattr(read_once.keys, name)
    if name in read_once.raw:
        return seconds(read_once.raw[name])
    defaults = HarvestConfig(dsn="")
    return getattr(defaults.limits if name in LIMIT_NAMES else defaults, name)


def kafka_config() -> dict[str, Any]:
    """librdkafka settings every client shares: OUTBOX["base_kafka_config"] as the user wrote it (not HarvestConfig's
    default, which names localhost), with bootstrap.servers from KAFKA_BOOTSTRAP_SERVERS (else localhost:9092) when
    it does not set them."""
    base = current().raw.get("base_kafka_config", {})
    return bootstrap(base if isinstance(base, Mapping) else {}, os.environ, 'OUTBOX["base_kafka_config"]')[0]


def database_alias() -> str:
    return setting("database")


def alias_problem(alias: Any) -> str | None:
    """Why `alias` cannot name the outbox's database (naming it and the aliases there are), or None."""
    if not isinstance(alias, str) or alias not in settings.DATABASES:
        there = ", ".join(repr(name) for name in settings.DATABASES) or "none"
        return f"must name an entry of DATABASES, got {alias!r} (DATABASES has {there})"
    if "postgresql" not in settings.DATABASES[alias].get("ENGINE", ""):
        return f"{alias!r} must use django.db.backends.postgresql"
    return None


def secret_settings() -> tuple[Any, Any]:
    """The settings that hold secrets: OUTBOX and DATABASES (redaction.secret_values reads them)."""
    return getattr(settings, "OUTBOX", {}), getattr(settings, "DATABASES", {})


def secret_values() -> set[str]:
    """The secret values in OUTBOX and DATABASES, to mask wherever a message might quote them."""
    return redaction.secret_values(*secret_settings())


def dsn_for(alias: str) -> str:
    """A libpq connection string for a Django database alias; the engine opens its own connections."""
    conf = connections[alias].settings_dict
    params = {
        "dbname": conf.get("NAME") or None,
        "user": conf.get("USER") or None,
        "password": conf.get("PASSWORD") or None,
        "host": conf.get("HOST") or None,
        "port": str(conf["PORT"]) if conf.get("PORT") else None,
    }
    for option, value in (conf.get("OPTIONS") or {}).items():
        if option not in _NON_LIBPQ_OPTIONS and isinstance(value, str | int):
            params[option] = str(value)
    return make_conninfo(**{k: v for k, v in params.items() if v is not None})


def database_place(alias: str) -> tuple[str, str, str]:
    """Where an alias's database is (host, port, name): two aliases of one database read the same rows."""
    conf = settings.DATABASES.get(alias, {})
    return str(conf.get("HOST") or ""), str(conf.get("PORT") or ""), str(conf.get("NAME") or "")


def default_leader_name(alias: str, table: str) -> str:
    """The leader topic and group when OUTBOX does not name them: one per database and table, so two
    outboxes sharing a Kafka cluster never share a group (which would leave one unharvested)."""
    conf = connections[alias].settings_dict
    return leader_name(conf.get("HOST"), conf.get("PORT"), conf.get("NAME"), table,
                       (conf.get("OPTIONS") or {}).get("options"))


def build(**overrides: Any) -> tuple[HarvestConfig, set[str], str | None]:
    """The engine's config from OUTBOX, the environment and overrides (None ones ignored), the limits given, and where
    bootstrap.servers came from (None: nowhere, W006)."""
    values = {**current().raw, **{k: v for k, v in overrides.items() if v is not None}}
    alias = values.get("database", OutboxKeys.database)
    table = values.get("table", HarvestConfig.table)
    known = isinstance(alias, str) and alias in settings.DATABASES
    derived = default_leader_name(alias, table) if isinstance(table, str) and known else "outbox-leader"
    return from_values(values, dsn=values.get("dsn") or (dsn_for(alias) if known else ""), derived_leader=derived,
                       environ=os.environ, given_by='OUTBOX["base_kafka_config"]')


def harvest_config(**overrides: Any) -> HarvestConfig:
    """The engine's config from OUTBOX, the environment and overrides (e.g. command-line flags).

    Overrides whose value is None are ignored, so argparse defaults can be passed straight through.
    """
    return build(**overrides)[0]
