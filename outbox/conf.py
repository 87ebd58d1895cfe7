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
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django.apps import apps
from django.conf import settings
from django.db import connections
from psycopg.conninfo import make_conninfo

from outbox.harvest.config import LIMIT_NAMES, SETTING_KEYS, HarvestConfig, Limits, leader_name
from outbox.kafka import redaction
from outbox.kafka.names import default_name

#: HarvestConfig fields a user sets through OUTBOX (dsn comes from DATABASES, the limits are LIMIT_NAMES).
ENGINE_KEYS = SETTING_KEYS
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
#: What each OUTBOX key does, with its default as the reference shows it (None: the code's own default, shown as
#: written). docs/reference/settings.md is written from these and from the limits' own docs (harvest.config.Limits);
#: a key the code knows without a meaning here fails tests/unit/test_docs.py.
MEANINGS: dict[str, tuple[str | None, str]] = {
    "database": ("`\"default\"`",
        "`DATABASES` alias of the outbox: the harvester connects to it (with its own connections), the admin reads "
        "it"),
    "table": ("`\"outbox\"`",
        "table to harvest, optionally `schema.table` (harvester only: `stash()` writes the model's table; "
        "`outbox.W003` when they differ)"),
    "base_kafka_config": ("`{}`",
        "librdkafka settings for every client: `bootstrap.servers` (else `KAFKA_BOOTSTRAP_SERVERS`, else "
        "`localhost:9092`), `security.protocol`, `sasl.*`, `ssl.*`"),
    "producer_kafka_config": ("`{}`",
        "librdkafka settings for the record producer only: `compression.type`, `batch.size`, ..."),
    "leader_topic": ("`outbox-leader.<database>.<table>.<hash>`",
        "leader-election topic, created if missing; derived from the database and table so two outboxes never share "
        "one"),
    "leader_group": ("as `leader_topic`",
        "leader-election consumer group"),
    "name": ("`host_pid_starttime`",
        "replica name in logs, heartbeats and status rows"),
    "listen": ("`True`",
        "LISTEN for the table trigger's NOTIFY and wake at once"),
    "park_after": ("`None`",
        "park a record automatically after this many permanent failures (off: a poison record holds its key until "
        "an operator acts; parking trades order for liveness)"),
    "shards": ("`1`",
        "harvest the table in this many shards (1-256), each led by one replica of the group (`manage.py harvest "
        "--shards N`; docs/scaling.md); every replica of a group runs the same N"),
    "dead_letter_topic": ("`None`",
        "also publish parked records (kept in the `outbox_dead_letter` table) to this topic"),
    "max_value_bytes": ("`900000`",
        "stash()'s limit on a value's UTF-8 size"),
    "max_header_bytes": ("`65536`",
        "stash()'s limit on all of a record's headers"),
    "status_table": ("`\"outbox_harvester\"`",
        "table of replica status rows (`None`: do not write them)"),
    "status_prune_after": ("`3600`",
        "status rows not seen for this long are deleted"),
    "history_retention": ("`86400`",
        "history samples (the dashboard's charts, `outbox_harvester_history`) older than this are deleted"),
    "dead_letter_retention": ("`2592000`",
        "parked records (`outbox_dead_letter`) parked longer ago than this (30 days) are deleted by the leader in "
        "batches of 10,000; `None` keeps them until an operator acts"),
    "status_gone_after": ("`20`",
        "the dashboard and `harvest_health` call a replica not seen for this long gone"),
    "stuck_after": ("`300`",
        "records waiting or in flight longer than this (since written) are stuck"),
    "stuck_reset_count": ("`3`",
        "... and records whose delivery failed this often"),
    "horizon_warn_after": ("`60`",
        "the dashboard, `harvest_health` and `outbox_horizon_age_seconds` say who holds the database's horizon back "
        "(a transaction left open, a report) once it has for this long; the harvester does not wait for it, but the "
        "outbox's dead rows pile up"),
    "queues": ("`{}`",
        "message queues: [docs/queues.md](../queues.md)"),
    "tracing": ("`True`",
        "OpenTelemetry trace context at `stash()`/`send()` and spans in the harvester and queue consumers, when "
        "`opentelemetry-api` is installed (the `[otel]` extra); `False`: nothing is added and nothing of "
        "OpenTelemetry imported: [docs/tracing.md](../tracing.md)"),
    "cloudevents": ("`None`",
        "publish these topics' records as CloudEvents in Kafka's binary mode: `{\"source\": \"/shop\", \"types\": "
        "{\"orders\": \"com.example.shop.order\"}, \"content_type\": \"application/json\"}` "
        "(`stash(..., cloudevent=...)` per call): [docs/tracing.md](../tracing.md#cloudevents)"),
    "outboxes": ("`None`",
        "several outboxes in one `harvest` process, each with its own leader group (or shards), fence and status "
        "row: `{\"shop\": {}, \"billing\": {\"database\": \"billing\", \"shards\": 4}, "
        "\"tenants\": {\"tenant_schemas\": True, \"exclude_schemas\": [\"public\"]}}`; an entry may set "
        "`database`, `table`, `leader_topic`, `leader_group`, "
        "`shards`, `listen`, `dead_letter_topic`, `park_after`, `tenant_schemas`, `exclude_schemas`: "
        "[docs/scaling.md](../scaling.md#many-outboxes-in-one-process)"),
    "discover_interval": ("`30`",
        "how often those outboxes are looked for again: a tenant schema created meanwhile gets harvested, a dropped "
        "one's engine stops"),
    "tests_require_atomic": ("`True`",
        "under Django's `TestCase` and pytest-django's `db`, `stash()` outside an `atomic()` of the code's own "
        "raises `OutsideTransaction`, as in production; `False` lets the test's own transaction count: "
        "[docs/testing.md](../testing.md)"),
    "spark_jars": ("`None`",
        "`outbox_audit`'s Kafka connector jars (else `$OUTBOX_SPARK_JARS`, else what `bin/services up` fetched): "
        "[docs/audit.md](../audit.md)"),
}
#: The limits as the reference shows them: default (as written) and meaning.
LIMIT_MEANINGS: dict[str, tuple[str, str]] = {
    "max_in_flight_records": ("4000",
        "records sent and not yet acknowledged and purged (the throttle)"),
    "max_in_flight_per_key": ("256",
        "records of one key in flight at once (1: goharvest's barrier)"),
    "mark_query_records": ("1000",
        "rows marked by one mark query"),
    "min_poll_interval": ("0.1",
        "the leader topic is polled at least this often"),
    "heartbeat_timeout": ("5.0",
        "a leader that sees none of its own heartbeats for this long fences itself; Kafka's session timeout is 3x "
        "this (at most 1200: librdkafka takes a session timeout of an hour at most)"),
    "max_poll_interval": ("`heartbeat_timeout / 2`",
        "an engine stalled this long between polls re-marks"),
    "queue_timeout": ("30.0",
        "a marked record waiting this long to be sent forces a re-mark"),
    "delivery_timeout": ("`1.5 x heartbeat_timeout`",
        "a record not acknowledged this long is given up and re-marked"),
    "drain_interval": ("`min(max_poll_interval, queue_timeout)`",
        "longest wait on one condition before deadlines are rechecked"),
    "mark_backoff": ("0.01",
        "pause after a mark that found nothing when nothing wakes the leader (no trigger, LISTEN off)"),
    "idle_poll_interval": ("1.0",
        "safety-net poll of an idle leader that the trigger's NOTIFY wakes (60 by default when one process harvests "
        "several outboxes, `OUTBOX[\"outboxes\"]`: their shared LISTEN session wakes them after every reconnect too)"),
    "rescan_interval": ("none",
        "retired: accepted with `outbox.W004`, does nothing (marks look up the ids not visible yet by key)"),
    "purge_interval": ("0.01",
        "purges are coalesced: at most one statement this often, deleting everything acknowledged meanwhile"),
    "purge_delay": ("0.1",
        "acknowledged records nothing waits on (no later record of their key, the throttle, a stop or a revoke) are "
        "purged together, at most this long after the first was acknowledged: one `DELETE` for many wakes at a "
        "steady rate, a tenth of the purges' database CPU at 2,000 records/s, the commit-to-ack p99 in the range it "
        "had (docs/benchmarks.md, issue 28); they stay in the table that much longer, so a crash of the harvester "
        "may repeat them; 0: every `purge_interval`"),
    "held_check_interval": ("1.0",
        "held (poison) rows are re-read this often, so a fix, a deletion or an operator's action is seen"),
    "held_retry_after": ("60.0",
        "a held record is tried again after this long (doubling, up to 16 times it)"),
    "topic_limits_interval": ("60.0",
        "each topic's `max.message.bytes` is read again from Kafka this often (also at once after Kafka refused a "
        "batch for its size): the record producer's batches fit the smallest, and a record that cannot fit is held "
        "before it is produced"),
    "fence_retry_interval": ("5.0",
        "a leader blocked by another's database fence tries again this often"),
    "io_error_backoff": ("0.5",
        "pause before retrying a failed database or Kafka call"),
    "min_metrics_interval": ("5.0",
        "throughput is logged (when it moved) and signalled at most this often"),
    "status_interval": ("2.0",
        "the replica's status row is written this often (0: never)"),
    "history_interval": ("10.0",
        "a sample of the replica's figures is added to the history (the dashboard's charts) this often, with its "
        "status row (0: never)"),
}
#: Settings that did something once and do nothing now: accepted, with a warning saying so.
RETIRED_KEYS: dict[str, str] = {
    "rescan_interval": "marks look up the ids that were not visible yet by key; nothing re-reads the table from "
                       "its head any more",
}
#: Keys of the apps beside this one, known when that app is installed (its own checks read them).
APP_KEYS = {"queues": "outbox.queue"}
DEFAULT_BOOTSTRAP_SERVERS = "localhost:9092"
# Keys of a Django DATABASES OPTIONS dict that configure Django or psycopg objects, not libpq.
_NON_LIBPQ_OPTIONS = {"pool", "isolation_level", "server_side_binding", "assume_role", "cursor_factory", "context"}
_ENGINE_DEFAULTS = {f.name: f for f in dataclasses.fields(HarvestConfig)}


def known_keys() -> frozenset[str]:
    installed = frozenset(key for key, app in APP_KEYS.items() if apps.is_installed(app))
    return (frozenset(DJANGO_DEFAULTS) | frozenset(ENGINE_KEYS) | frozenset(LIMIT_NAMES) | installed
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
    return leader_name(conf.get("HOST"), conf.get("PORT"), conf.get("NAME"), table)


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
