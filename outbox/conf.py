"""Django settings (`OUTBOX = {...}` and the environment) to the engine's one frozen config.

Every key of OUTBOX is known here; a typo is a system-check error, not a silent default.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import connections
from psycopg.conninfo import make_conninfo

from outbox.harvest.config import HarvestConfig, Limits, Problem, default_name, notify_channel

LIMIT_NAMES = tuple(f.name for f in dataclasses.fields(Limits))

#: Defaults for every OUTBOX key that is not a goharvest limit (those default in Limits).
DEFAULTS: dict[str, Any] = {
    "database": "default",
    "table": "outbox",
    "base_kafka_config": {},
    "producer_kafka_config": {},
    "leader_topic": None,  # derived from the project's name
    "leader_group": None,  # derived from the project's name
    "name": None,  # host_pid_starttime
    "listen": True,
    "notify": True,
    "max_value_bytes": 900_000,
    "max_header_bytes": 64 * 1024,
    "status_table": "outbox_harvester",
    "status_prune_after": 3600.0,
    # The dashboard and harvest_health: a replica not seen for this long is gone.
    "status_gone_after": 20.0,
    # The dashboard's stuck records: pending longer than this, or reset at least this often.
    "stuck_after": 300.0,
    "stuck_reset_count": 3,
    "spark_jars": None,  # the audit's Kafka connector jars: a folder or a list (see docs/audit.md)
}
KNOWN_KEYS = frozenset(DEFAULTS) | frozenset(LIMIT_NAMES)
DEFAULT_BOOTSTRAP_SERVERS = "localhost:9092"
# Keys of a Django DATABASES OPTIONS dict that configure Django or psycopg objects, not libpq.
_NON_LIBPQ_OPTIONS = {"pool", "isolation_level", "server_side_binding", "assume_role", "cursor_factory", "context"}


def raw_settings() -> dict[str, Any]:
    value = getattr(settings, "OUTBOX", {})
    return dict(value) if isinstance(value, Mapping) else value


def setting(name: str) -> Any:
    """One OUTBOX value with its default (for keys that are not engine limits)."""
    raw = raw_settings()
    return raw.get(name, DEFAULTS[name]) if isinstance(raw, dict) else DEFAULTS[name]


def project_name() -> str:
    module = os.environ.get("DJANGO_SETTINGS_MODULE") or getattr(settings, "SETTINGS_MODULE", None) or "django"
    return module.split(".")[0]


def settings_problems() -> list[Problem]:
    """Problems with the shape of OUTBOX itself: not a dict, unknown keys, bad stash limits."""
    raw = raw_settings()
    if not isinstance(raw, dict):
        return [Problem("E001", "OUTBOX", f"must be a dict, got {type(raw).__name__}")]
    found = []
    for key in sorted(set(raw) - KNOWN_KEYS, key=str):
        close = difflib.get_close_matches(str(key), sorted(KNOWN_KEYS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        found.append(Problem("E002", f"OUTBOX[{key!r}]", f"is not a known setting{hint}"))
    for key in ("max_value_bytes", "max_header_bytes"):
        value = raw.get(key, DEFAULTS[key])
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            found.append(Problem("E003", key, f"must be a positive integer, got {value!r}"))
    for key in ("notify", "listen"):
        if not isinstance(raw.get(key, DEFAULTS[key]), bool):
            found.append(Problem("E003", key, f"must be True or False, got {raw.get(key)!r}"))
    for key in ("status_gone_after", "stuck_after"):
        value = _seconds(raw.get(key, DEFAULTS[key]))
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            found.append(Problem("E003", key, f"must be a positive number of seconds, got {value!r}"))
    value = raw.get("stuck_reset_count", DEFAULTS["stuck_reset_count"])
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        found.append(Problem("E003", "stuck_reset_count", f"must be a positive integer, got {value!r}"))
    spark_jars = raw.get("spark_jars")
    if spark_jars is not None and not (isinstance(spark_jars, str) or (
            isinstance(spark_jars, list | tuple) and all(isinstance(item, str) for item in spark_jars))):
        found.append(Problem("E003", "spark_jars", f"must be a path or a list of paths, got {spark_jars!r}"))
    database = raw.get("database", DEFAULTS["database"])
    if database not in settings.DATABASES:
        found.append(Problem("E011", "database", f"must name an entry of DATABASES, got {database!r}"))
    elif "postgresql" not in settings.DATABASES[database].get("ENGINE", ""):
        found.append(Problem("E012", "database", f"{database!r} must use django.db.backends.postgresql"))
    return found


def problems() -> list[Problem]:
    """Everything wrong with the outbox settings, for `manage.py check`."""
    found = settings_problems()
    if any(p.code in {"E001", "E011", "E012"} for p in found):
        return found
    try:
        config = harvest_config()
    except (TypeError, ValueError) as error:  # a value too malformed to build the config from
        return [*found, Problem("E003", "OUTBOX", str(error))]
    return found + [p for p in config.validate() if p not in found]


def warnings() -> list[Problem]:
    """Settings that work but weaken a guarantee, for `manage.py check`."""
    if settings_problems():
        return []
    try:
        return harvest_config().warnings()
    except (TypeError, ValueError):
        return []


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


def _seconds(value: Any) -> Any:
    return value.total_seconds() if isinstance(value, timedelta) else value


def harvest_config(**overrides: Any) -> HarvestConfig:
    """The engine's config from OUTBOX, the environment and overrides (e.g. command-line flags).

    Overrides whose value is None are ignored, so argparse defaults can be passed straight through.
    """
    raw = raw_settings()
    raw = raw if isinstance(raw, dict) else {}
    values = {**DEFAULTS, **raw, **{k: v for k, v in overrides.items() if v is not None}}
    limits = Limits(**{name: _seconds(values[name]) for name in LIMIT_NAMES if name in values})
    base = dict(values["base_kafka_config"] or {}) if isinstance(values["base_kafka_config"], Mapping) else {}
    base.setdefault("bootstrap.servers", os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or DEFAULT_BOOTSTRAP_SERVERS)
    producer = values["producer_kafka_config"]
    derived = f"{project_name()}-outbox-leader"
    return HarvestConfig(
        dsn=values.get("dsn") or dsn_for(values["database"]),
        table=values["table"],
        base_kafka_config=base,
        producer_kafka_config=dict(producer) if isinstance(producer, Mapping) else producer,
        leader_topic=values["leader_topic"] or derived,
        leader_group=values["leader_group"] or derived,
        name=values["name"] or default_name(),
        limits=limits,
        listen=values["listen"],
        status_table=values["status_table"],
        status_prune_after=_seconds(values["status_prune_after"]),
    )


def stash_channel(table: str) -> str | None:
    """The NOTIFY channel stash() signals for `table`, or None when notifying is off."""
    return notify_channel(table) if setting("notify") else None
