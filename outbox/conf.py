"""Django settings (`OUTBOX = {...}` and the environment) to the engine's one frozen config.

Every key of OUTBOX is known here; a typo is a system-check error, not a silent default. The
engine's own settings take their defaults from `HarvestConfig` and `Limits` (one place); this
module adds only what belongs to Django: which database, stash()'s limits, the admin's thresholds.

`database` means the same everywhere: stash() writes there by default, the admin and health probe
read there, the harvester harvests there. `table` is the harvester's: stash() and the admin always
use the model's table (`outbox`), and a check warns when the two differ.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import connections
from psycopg.conninfo import make_conninfo

from outbox.harvest import redaction
from outbox.harvest.config import HarvestConfig, Limits, Problem, default_name

LIMIT_NAMES = tuple(f.name for f in dataclasses.fields(Limits))
#: HarvestConfig fields a user sets through OUTBOX (dsn, name and limits come other ways).
ENGINE_KEYS = ("table", "base_kafka_config", "producer_kafka_config", "leader_topic", "leader_group", "name",
               "listen", "status_table", "status_prune_after", "history_retention", "dead_letter_topic",
               "dead_letter_retention", "park_after", "shards")
#: Settings that belong to the Django side, with their defaults.
DJANGO_DEFAULTS: dict[str, Any] = {
    "database": "default",
    "max_value_bytes": 900_000,
    "max_header_bytes": 64 * 1024,
    # The dashboard and harvest_health: a replica not seen for this long is gone.
    "status_gone_after": 20.0,
    # Records waiting longer than this (or failed this often) are shown as stuck.
    "stuck_after": 300.0,
    "stuck_reset_count": 3,
    # The dashboard, harvest_health and the metrics say who holds the database's horizon back this long.
    "horizon_warn_after": 60.0,
    "spark_jars": None,  # the audit's Kafka connector jars: a folder or a list (see docs/audit.md)
    # OpenTelemetry trace context at stash() and spans in the harvester and queue consumers, when
    # opentelemetry-api is installed (docs/tracing.md); False: nothing is added or imported.
    "tracing": True,
    # CloudEvents binary mode for these topics (outbox/cloudevents.py): {"source", "types", "content_type"}
    "cloudevents": None,
    # Several outboxes in one harvest process (outbox/many.py): {name: {"database", "table", "tenant_schemas", ...}}
    "outboxes": None,
    # How often those outboxes are looked for again (a tenant schema created meanwhile gets harvested).
    "discover_interval": 30.0,
    # In tests (Django's TestCase, pytest-django's `db`), stash() outside an atomic() of the code's own raises
    # OutsideTransaction, as in production; False lets the test framework's own atomic blocks count.
    "tests_require_atomic": True,
}
#: Settings that did something once and do nothing now: accepted, with a warning saying so.
RETIRED_KEYS: dict[str, str] = {
    "rescan_interval": "marks look up the ids that were not visible yet by key; nothing re-reads the table from "
                       "its head any more",
}
#: Keys other parts of the app register (outbox.queue adds "queues").
EXTRA_KEYS: set[str] = set()
DEFAULT_BOOTSTRAP_SERVERS = "localhost:9092"
# Keys of a Django DATABASES OPTIONS dict that configure Django or psycopg objects, not libpq.
_NON_LIBPQ_OPTIONS = {"pool", "isolation_level", "server_side_binding", "assume_role", "cursor_factory", "context"}
_ENGINE_DEFAULTS = {f.name: f for f in dataclasses.fields(HarvestConfig)}


def known_keys() -> frozenset[str]:
    return (frozenset(DJANGO_DEFAULTS) | frozenset(ENGINE_KEYS) | frozenset(LIMIT_NAMES) | frozenset(EXTRA_KEYS)
            | frozenset(RETIRED_KEYS))


def raw_settings() -> Any:
    value = getattr(settings, "OUTBOX", {})
    return dict(value) if isinstance(value, Mapping) else value


def setting(name: str) -> Any:
    """One OUTBOX value with its default."""
    raw = raw_settings()
    raw = raw if isinstance(raw, dict) else {}
    if name in raw:
        return _seconds(raw[name])
    if name in DJANGO_DEFAULTS:
        return DJANGO_DEFAULTS[name]
    if name in LIMIT_NAMES:
        return getattr(Limits(), name)
    spec = _ENGINE_DEFAULTS[name]
    return spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default


def kafka_config() -> dict[str, Any]:
    """librdkafka settings every client shares: OUTBOX["base_kafka_config"], with bootstrap.servers
    from KAFKA_BOOTSTRAP_SERVERS (else localhost:9092) when it does not set them."""
    base = setting("base_kafka_config")
    merged = dict(base) if isinstance(base, Mapping) else {}
    merged.setdefault("bootstrap.servers", os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or DEFAULT_BOOTSTRAP_SERVERS)
    return merged


def database_alias() -> str:
    return setting("database")


def settings_problems() -> list[Problem]:
    """Problems with OUTBOX itself and its Django-side keys (the engine's are HarvestConfig's)."""
    raw = raw_settings()
    if not isinstance(raw, dict):
        return [Problem("E001", "OUTBOX", f"must be a dict, got {type(raw).__name__}")]
    found = []
    known = known_keys()
    for key in sorted(set(raw) - known, key=str):
        close = difflib.get_close_matches(str(key), sorted(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        found.append(Problem("E002", str(key), f"is not a known setting{hint}"))
    for key in ("max_value_bytes", "max_header_bytes", "stuck_reset_count"):
        value = raw.get(key, DJANGO_DEFAULTS[key])
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            found.append(Problem("E003", key, f"must be a positive integer, got {value!r}"))
    for key in ("status_gone_after", "stuck_after", "horizon_warn_after", "discover_interval"):
        value = _seconds(raw.get(key, DJANGO_DEFAULTS[key]))
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            found.append(Problem("E003", key, f"must be a positive number of seconds, got {value!r}"))
    spark_jars = raw.get("spark_jars")
    if spark_jars is not None and not (isinstance(spark_jars, str) or (
            isinstance(spark_jars, list | tuple) and all(isinstance(item, str) for item in spark_jars))):
        found.append(Problem("E003", "spark_jars", f"must be a path or a list of paths, got {spark_jars!r}"))
    tracing = raw.get("tracing", True)
    if not isinstance(tracing, bool):
        found.append(Problem("E015", "tracing", f"must be True or False, got {tracing!r}"))
    strict = raw.get("tests_require_atomic", True)
    if not isinstance(strict, bool):
        found.append(Problem("E003", "tests_require_atomic", f"must be True or False, got {strict!r}"))
    from outbox.cloudevents import settings_problems as cloudevent_problems

    found.extend(Problem("E016", field, message) for field, message in cloudevent_problems(raw.get("cloudevents")))
    from outbox.many import problems as outboxes_problems

    found.extend(outboxes_problems(raw.get("outboxes")))
    database = raw.get("database", DJANGO_DEFAULTS["database"])
    problem = alias_problem(database)
    if problem is not None:
        found.append(Problem("E011" if database not in settings.DATABASES else "E012", "database", problem))
    return found


def alias_problem(alias: Any) -> str | None:
    """Why `alias` cannot name the outbox's database (naming it and the aliases there are), or None."""
    if not isinstance(alias, str) or alias not in settings.DATABASES:
        there = ", ".join(repr(name) for name in settings.DATABASES) or "none"
        return f"must name an entry of DATABASES, got {alias!r} (DATABASES has {there})"
    if "postgresql" not in settings.DATABASES[alias].get("ENGINE", ""):
        return f"{alias!r} must use django.db.backends.postgresql"
    return None


def secret_values() -> set[str]:
    """The secret values in OUTBOX and DATABASES, to mask wherever a message might quote them."""
    return redaction.secret_values(raw_settings(), getattr(settings, "DATABASES", {}))


def problems(**overrides: Any) -> list[Problem]:
    """Everything wrong with the outbox settings (with command-line overrides), for `manage.py check`."""
    found = settings_problems()
    if any(p.code in {"E001", "E011", "E012"} for p in found):
        return found
    alias = overrides.get("database")
    if alias is not None and (problem := alias_problem(alias)) is not None:
        return [*found, Problem("E011", "database", problem)]
    config, given = _build(**overrides)
    engine = config.validate(given_limits=given)
    if not engine:
        from outbox.harvest.kafka import client_config_problems

        engine = client_config_problems(config)
    return found + engine


def warnings() -> list[Problem]:
    """Settings that work but weaken a guarantee, for `manage.py check`."""
    if settings_problems():
        return []
    config, given = _build()
    if config.validate(given_limits=given):
        return []
    found = config.warnings()
    from outbox.models import OutboxRecord

    raw = raw_settings()
    for key, why in RETIRED_KEYS.items():
        if key in raw:
            found.append(Problem("W004", key, f"no longer does anything ({why}); remove it"))
    from outbox.tracing.switch import otel_installed

    if raw.get("tracing") is True and not otel_installed():
        found.append(Problem("W005", "tracing", "is True but opentelemetry-api is not installed, so nothing is "
                                                "traced: install django-outbox-harvest[otel]"))
    if config.table != OutboxRecord._meta.db_table:
        found.append(Problem("W003", "table", f"the harvester harvests {config.table!r}, while stash() and the admin "
                                              f"use the model's table {OutboxRecord._meta.db_table!r}"))
    return found


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
    for key, value in (conf.get("OPTIONS") or {}).items():
        if key not in _NON_LIBPQ_OPTIONS and isinstance(value, str | int):
            params[key] = str(value)
    return make_conninfo(**{k: v for k, v in params.items() if v is not None})


def default_leader_name(alias: str, table: str) -> str:
    """The leader topic and group when OUTBOX does not name them: one per database and table, so two
    outboxes sharing a Kafka cluster never share a group (which would leave one unharvested)."""
    conf = connections[alias].settings_dict
    where = f"{conf.get('HOST') or 'localhost'}:{conf.get('PORT') or 5432}/{conf.get('NAME') or ''}/{table}"
    readable = re.sub(r"[^a-zA-Z0-9._-]", "_", f"{conf.get('NAME') or 'db'}.{table}")[:180]
    return f"outbox-leader.{readable}.{hashlib.sha1(where.encode()).hexdigest()[:8]}"


def _seconds(value: Any) -> Any:
    return value.total_seconds() if isinstance(value, timedelta) else value


def _build(**overrides: Any) -> tuple[HarvestConfig, set[str]]:
    raw = raw_settings()
    raw = raw if isinstance(raw, dict) else {}
    values = {**raw, **{k: v for k, v in overrides.items() if v is not None}}
    given = {name for name in LIMIT_NAMES if name in values}
    limits = Limits(**{name: _seconds(values[name]) for name in given})
    engine = {key: _seconds(values[key]) for key in ENGINE_KEYS if key in values}
    alias = values.get("database", DJANGO_DEFAULTS["database"])
    base = engine.get("base_kafka_config", {})
    if isinstance(base, Mapping):
        engine["base_kafka_config"] = {**kafka_config(), **base}
    table = engine.get("table", _ENGINE_DEFAULTS["table"].default)
    derived = default_leader_name(alias, table) if isinstance(table, str) and alias in settings.DATABASES else None
    config = HarvestConfig(
        dsn=values.get("dsn") or (dsn_for(alias) if alias in settings.DATABASES else ""),
        **{**engine, "leader_topic": engine.get("leader_topic") or derived or "outbox-leader",
           "leader_group": engine.get("leader_group") or derived or "outbox-leader",
           "name": engine.get("name") or default_name(), "limits": limits},
    )
    return config, given


def given_limits(**overrides: Any) -> set[str]:
    """The limits set explicitly, in OUTBOX or by an override whose value is not None."""
    return _build(**overrides)[1]


def harvest_config(**overrides: Any) -> HarvestConfig:
    """The engine's config from OUTBOX, the environment and overrides (e.g. command-line flags).

    Overrides whose value is None are ignored, so argparse defaults can be passed straight through.
    """
    return _build(**overrides)[0]
