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
import hashlib
import os
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import connections
from psycopg.conninfo import make_conninfo

from outbox.harvest.config import HarvestConfig, Limits
from outbox.kafka import redaction
from outbox.kafka.names import default_name

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
        return seconds(raw[name])
    if name in DJANGO_DEFAULTS:
        return DJANGO_DEFAULTS[name]
    if name in LIMIT_NAMES:
        return getattr(Limits(), name)
    spec = _ENGINE_DEFAULTS[name]
    return spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default


def bootstrap_source() -> str | None:
    """Where bootstrap.servers comes from: OUTBOX["base_kafka_config"], else KAFKA_BOOTSTRAP_SERVERS; None when
    neither sets it (every client then tries localhost:9092)."""
    base = _given_kafka_config()
    if base.get("bootstrap.servers"):
        return 'OUTBOX["base_kafka_config"]'
    return "KAFKA_BOOTSTRAP_SERVERS" if os.environ.get("KAFKA_BOOTSTRAP_SERVERS") else None


def kafka_config() -> dict[str, Any]:
    """librdkafka settings every client shares: OUTBOX["base_kafka_config"], with bootstrap.servers
    from KAFKA_BOOTSTRAP_SERVERS (else localhost:9092) when it does not set them."""
    merged = _given_kafka_config()
    merged.setdefault("bootstrap.servers", os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or DEFAULT_BOOTSTRAP_SERVERS)
    return merged


def _given_kafka_config() -> dict[str, Any]:
    """OUTBOX["base_kafka_config"] as the user wrote it (not HarvestConfig's default, which names localhost)."""
    raw = raw_settings()
    base = raw.get("base_kafka_config", {}) if isinstance(raw, dict) else {}
    return dict(base) if isinstance(base, Mapping) else {}


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


def secret_values() -> set[str]:
    """The secret values in OUTBOX and DATABASES, to mask wherever a message might quote them."""
    return redaction.secret_values(raw_settings(), getattr(settings, "DATABASES", {}))


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


def seconds(value: Any) -> Any:
    return value.total_seconds() if isinstance(value, timedelta) else value


def build(**overrides: Any) -> tuple[HarvestConfig, set[str]]:
    raw = raw_settings()
    raw = raw if isinstance(raw, dict) else {}
    values = {**raw, **{k: v for k, v in overrides.items() if v is not None}}
    given = {name for name in LIMIT_NAMES if name in values}
    limits = Limits(**{name: seconds(values[name]) for name in given})
    engine = {key: seconds(values[key]) for key in ENGINE_KEYS if key in values}
    alias = values.get("database", DJANGO_DEFAULTS["database"])
    base = engine.get("base_kafka_config", {})
    if isinstance(base, Mapping):  # bootstrap.servers: OUTBOX's, else KAFKA_BOOTSTRAP_SERVERS, else localhost:9092
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
    return build(**overrides)[1]


def harvest_config(**overrides: Any) -> HarvestConfig:
    """The engine's config from OUTBOX, the environment and overrides (e.g. command-line flags).

    Overrides whose value is None are ignored, so argparse defaults can be passed straight through.
    """
    return build(**overrides)[0]
