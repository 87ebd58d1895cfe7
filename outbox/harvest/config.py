"""The harvester's configuration: one frozen object, defaults in one place, one validate().

Durations are seconds (floats), as in Django's own settings. Names follow
goharvest's limits in snake_case. Nothing here imports Django.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from outbox.harvest.sharding import shards_problem
from outbox.kafka.keys import (
    DEFAULT_BOOTSTRAP_SERVERS,
    boolean,
    bootstrap,
    is_int,
    is_number,
    key,
    positive_int,
    positive_seconds,
    positive_seconds_or_none,
    rule,
    rule_problems,
    seconds,
)
from outbox.kafka.names import TOPIC_NAME, default_name, is_topic_name, name_problem
from outbox.kafka.problems import Problem
from outbox.kafka.redaction import redact_dsn, redact_mapping

# An unquoted SQL identifier, optionally schema-qualified: [schema.]table.
TABLE_PATTERN = re.compile(r"(?:[A-Za-z_][A-Za-z0-9_$]{0,62}\.)?[A-Za-z_][A-Za-z0-9_$]{0,62}")


def limit(default: float | int | None, minimum: float | str, doc: str, maximum: float | None = None,
          shown: str | None = None) -> Any:
    """A Limits field: its default, the least value it accepts (or the name of the field that is
    its least value), the most (if any), what it does, and its default as the reference shows a derived one."""
    return field(default=default, metadata={"minimum": minimum, "maximum": maximum, "doc": doc, "shown": shown})


#: The least heartbeat_timeout Kafka's brokers accept by default: the leader group's session timeout is 3 x it, and
#: group.min.session.timeout.ms is 6 s (W007 below it; the leader consumer's refusal ends the harvester).
MIN_HEARTBEAT_TIMEOUT = 2.0

#: The limits whose default is derived from others (Limits.__post_init__), and those others: a problem is
#: reported on the limit the user set, not again on each limit derived from it.
DERIVED_FROM = {"max_poll_interval": ("heartbeat_timeout",),
                "drain_interval": ("heartbeat_timeout", "max_poll_interval", "queue_timeout"),
                "delivery_timeout": ("heartbeat_timeout",)}


@dataclass(frozen=True)
class Limits:
    """Timing and sizing limits, in seconds and counts; goharvest's names where goharvest has one. Each field's doc
    is its line in the settings reference; the defaults are measured on a stock Postgres (docs/tuning.md)."""

    io_error_backoff: float = limit(0.5, 0.0, "pause before retrying a failed database or Kafka call")
    min_poll_interval: float = limit(0.1, 0.001, "the leader topic is polled at least this often, so Kafka sees the "
                                                 "replica alive")
    heartbeat_timeout: float = limit(5.0, 0.001, "a leader that sees none of its own heartbeats for this long fences "
                                                 "itself; Kafka's session timeout is 3x this (at most 1200: "
                                                 "librdkafka takes a session timeout of an hour at most)",
                                     maximum=1200.0)
    max_poll_interval: float | None = limit(None, "min_poll_interval", "an engine stalled this long between polls "
                                                                       "re-marks", shown="`heartbeat_timeout / 2`")
    drain_interval: float | None = limit(None, 0.001, "longest wait on one condition before deadlines are rechecked",
                                         shown="`min(max_poll_interval, queue_timeout)`")
    queue_timeout: float = limit(30.0, 0.001, "a marked record waiting this long to be sent forces a re-mark")
    delivery_timeout: float | None = limit(None, 0.001, "a record not acknowledged this long is given up and "
                                                        "re-marked (so a fenced leader's last records cannot land "
                                                        "after a new leader has started)",
                                           shown="`1.5 x heartbeat_timeout`")
    mark_backoff: float = limit(0.01, 0.0, "pause after a mark that found nothing when nothing wakes the leader (no "
                                           "trigger, LISTEN off)")
    idle_poll_interval: float = limit(1.0, 0.001, "safety-net poll of an idle leader that the trigger's NOTIFY "
                                                  "wakes (60 by default when one process harvests several outboxes, "
                                                  "`OUTBOX[\"outboxes\"]`: their shared LISTEN session wakes them "
                                                  "after every reconnect too)")
    max_in_flight_records: int = limit(4000, 1, "records sent and not yet acknowledged and purged (the throttle)")
    max_in_flight_per_key: int = limit(256, 1, "records of one key in flight at once (1: goharvest's barrier; more "
                                               "pipelines hot keys, docs/guarantees.md)")
    mark_query_records: int = limit(1000, 1, "rows marked by one mark query")
    purge_interval: float = limit(0.01, 0.0, "purges are coalesced: at most one statement this often, deleting "
                                             "everything acknowledged meanwhile")
    purge_delay: float = limit(0.1, 0.0, "acknowledged records nothing waits on (no later record of their key, the "
                                         "throttle, a stop or a revoke) are purged together, at most this long after "
                                         "the first was acknowledged: one `DELETE` for many wakes at a steady rate, "
                                         "a tenth of the purges' database CPU at 2,000 records/s "
                                         "(docs/benchmarks.md); they stay in the table that much longer, so a crash "
                                         "of the harvester may repeat them; 0: every `purge_interval`")
    held_check_interval: float = limit(1.0, 0.001, "held (poison) rows are re-read this often, so a fix, a deletion "
                                                   "or an operator's action is seen")
    held_retry_after: float = limit(60.0, 0.001, "a held record is tried again after this long (doubling, up to 16 "
                                                 "times it)")
    fence_retry_interval: float = limit(5.0, 0.001, "a leader blocked by another's database fence tries again this "
                                                    "often")
    topic_limits_interval: float = limit(60.0, 0.001, "each topic's `max.message.bytes` is read again from Kafka "
                                                      "this often (also at once after Kafka refused a batch for its "
                                                      "size): the record producer's batches fit the smallest, and a "
                                                      "record that cannot fit is held before it is produced")
    min_metrics_interval: float = limit(5.0, 0.0, "throughput is logged (when it moved) and signalled at most this "
                                                  "often")
    status_interval: float = limit(2.0, 0.0, "the replica's status row is written this often (0: never)")
    history_interval: float = limit(10.0, 0.0, "a sample of the replica's figures is added to the history (the "
                                               "dashboard's charts) this often, with its status row (0: never)")

    def __post_init__(self) -> None:
        # Derived defaults, as goharvest's SetDefaults; left unset when their inputs are bad so
        # that problems() reports the input rather than this raising.
        if self.max_poll_interval is None and is_number(self.heartbeat_timeout):
            object.__setattr__(self, "max_poll_interval", self.heartbeat_timeout / 2)
        if self.drain_interval is None and is_number(self.max_poll_interval) and is_number(self.queue_timeout):
            object.__setattr__(self, "drain_interval", min(self.max_poll_interval, self.queue_timeout))
        if self.delivery_timeout is None and is_number(self.heartbeat_timeout):
            object.__setattr__(self, "delivery_timeout", 1.5 * self.heartbeat_timeout)

    @property
    def settle_timeout(self) -> float:
        """How long a leader that is stopping, or whose partition 0 was revoked, waits for its records
        in flight to settle (a delivery timeout, a failed purge retried twice, and a second) before it
        gives them up."""
        return self.delivery_timeout + 2 * self.io_error_backoff + 1.0

    def problems(self, given: Collection[str] | None = None) -> list[Problem]:
        """Every limit that is not a number of the right kind or is below its minimum.

        `given` names the limits that were set explicitly; a derived limit that was not given is
        only checked when its inputs are fine (its inputs' own problems are reported instead).
        """
        found: list[Problem] = []
        # The limits others derive from first, so a derived one's inputs have been checked when it is reached.
        for spec in sorted(dataclasses.fields(self), key=lambda spec: spec.name in DERIVED_FROM):
            value = getattr(self, spec.name)
            derived = given is not None and spec.name in DERIVED_FROM and spec.name not in given
            if derived and (value is None or any(p.field in DERIVED_FROM[spec.name] for p in found)):
                continue  # derived from an input that is itself reported
            minimum = spec.metadata["minimum"]
            if isinstance(minimum, str):
                minimum = getattr(self, minimum) if is_number(getattr(self, minimum)) else 0.001
            integral = spec.type == "int"
            if isinstance(value, bool) or not (is_int(value) if integral else is_number(value)):
                kind = "an integer" if integral else "a number of seconds"
                found.append(Problem("E003", spec.name, f"must be {kind}, got {value!r}"))
            elif value < minimum:
                found.append(Problem("E004", spec.name, f"must be at least {minimum:g}, got {value!r}"))
            elif spec.metadata["maximum"] is not None and value > spec.metadata["maximum"]:
                # heartbeat_timeout: Kafka's session timeout is 3 x it, and librdkafka takes at most an hour.
                found.append(Problem("E004", spec.name, f"must be at most {spec.metadata['maximum']:g}, got "
                                                        f"{value!r}"))
        return found


#: The limits' names: OUTBOX keys, TOML keys and flags alike.
LIMIT_NAMES = tuple(spec.name for spec in dataclasses.fields(Limits))


def _number(value: Any) -> float | None:
    """A librdkafka property's value as a number (it may be a string), or None."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _sql_name(value: Any) -> bool:
    return isinstance(value, str) and TABLE_PATTERN.fullmatch(value) is not None


_mapping = rule(lambda value: isinstance(value, Mapping) and all(isinstance(k, str) for k in value),
                "must be a mapping of librdkafka property names to values", got=False)


@dataclass(frozen=True)
class HarvestConfig:
    """Everything a Harvester needs. Build it, call validate(), then hand it over.

    The fields a user sets by name (OUTBOX's keys, the stand-alone harvester's file keys: SETTING_KEYS) carry their
    meaning, the rule their value must meet and its check code; validate() reports each breach."""

    #: libpq connection string or URL for the database holding the outbox table (may carry a password).
    dsn: str = field(metadata={"rule": lambda dsn: None if isinstance(dsn, str) and dsn.strip() else
                               "must name the database holding the outbox table", "code": "E005"})
    table: str = key("outbox", "table to harvest, optionally `schema.table` (harvester only: `stash()` writes the "
                               "model's table; `outbox.W003` when they differ)",
                     rule(_sql_name, "must be an SQL identifier, optionally schema.table (at most 63 characters "
                                      "each)"), code="E006", shown='`"outbox"`')
    base_kafka_config: Mapping[str, Any] = key(
        {"bootstrap.servers": DEFAULT_BOOTSTRAP_SERVERS}, "librdkafka settings for every client: `bootstrap.servers` "
        "(else `KAFKA_BOOTSTRAP_SERVERS`, else `localhost:9092`), `security.protocol`, `sasl.*`, `ssl.*`", _mapping,
        code="E009", shown="`{}`")
    producer_kafka_config: Mapping[str, Any] = key({}, "librdkafka settings for the record producer only: "
                                                       "`compression.type`, `batch.size`, ...", _mapping, code="E009")
    leader_topic: str = key("outbox-harvest", "leader-election topic, created if missing; derived from the database "
                                              "and table (an unqualified table taken to be in the first schema of the "
                                              "search_path the connection's `options` set, else `public`) so two "
                                              "outboxes never share one",
                            rule(is_topic_name, TOPIC_NAME), code="E007",
                            shown="`outbox-leader.<database>.<table>.<hash>`")
    leader_group: str = key("outbox-harvest", "leader-election consumer group", name_problem, code="E008",
                            shown="`leader_topic`'s default, also where `leader_topic` is set")
    name: str = key(None, "replica name in logs, heartbeats and status rows", name_problem, code="E008",
                    shown="`host_pid_starttime`")
    limits: Limits = field(default_factory=Limits)
    listen: bool = key(True, "LISTEN for the table trigger's NOTIFY and wake at once", boolean)
    status_table: str | None = key("outbox_harvester", "table of replica status rows (`None`: do not write them)",
                                   rule(lambda v: v is None or _sql_name(v), "must be an SQL identifier or None"),
                                   code="E006")
    status_prune_after: float = key(3600.0, "status rows not seen for this long are deleted", positive_seconds,
                                    code="E004")
    history_retention: float = key(86400.0, "history samples (the dashboard's charts, `outbox_harvester_history`) "
                                            "older than this are deleted", positive_seconds, code="E004")
    #: Where parked (dead-letter) records go; parking is off if it does not exist (not a setting: the migrations').
    dead_letter_table: str | None = field(default="outbox_dead_letter", metadata={
        "rule": rule(lambda v: v is None or _sql_name(v), "must be an SQL identifier or None"), "code": "E006"})
    dead_letter_topic: str | None = key(None, "also publish parked records (kept in the `outbox_dead_letter` table) "
                                              "to this topic", rule(lambda v: v is None or is_topic_name(v),
                                                                    f"{TOPIC_NAME} or None"), code="E007")
    dead_letter_retention: float | None = key(30 * 86400.0, "parked records (`outbox_dead_letter`) parked longer ago "
                                                            "than this (30 days) are deleted by the leader in batches "
                                                            "of 10,000; `None` keeps them until an operator acts",
                                              positive_seconds_or_none, code="E004")
    park_after: int | None = key(None, "park a record automatically after this many permanent failures (off: a "
                                       "poison record holds its key until an operator acts; parking trades order "
                                       "for liveness)", rule(lambda v: v is None or positive_int(v) is None,
                                                              "must be a positive integer or None"), code="E004")
    shards: int = key(1, "harvest the table in this many shards (1-256), each led by one replica of the group "
                         "(`manage.py harvest --shards N`; docs/scaling.md); every replica of a group runs the same N",
                      shards_problem, code="E017")
    #: Which shard this engine harvests (0 to shards - 1); set by the sharded harvester for each of its engines.
    shard: int = 0

    def __post_init__(self) -> None:
        if self.name is None:
            object.__setattr__(self, "name", default_name())

    def for_shard(self, shard: int) -> HarvestConfig:
        """The config of this replica's engine for one shard."""
        return dataclasses.replace(self, shard=shard)

    def validate(self, *, given_limits: Collection[str] | None = None) -> list[Problem]:
        """Every problem at once; an empty list means the config is usable.

        `given_limits` names the limits set explicitly (see Limits.problems)."""
        found = rule_problems(self)
        if isinstance(self.base_kafka_config, Mapping) and not self.base_kafka_config.get("bootstrap.servers"):
            found.append(Problem("E010", "base_kafka_config", "must set bootstrap.servers"))
        if shards_problem(self.shards) is None and (not is_int(self.shard) or not 0 <= self.shard < self.shards):
            found.append(Problem("E017", "shard", f"must be from 0 to {self.shards - 1}, got {self.shard!r}"))
        if isinstance(self.limits, Limits):
            found.extend(self.limits.problems(given_limits))
        else:
            found.append(Problem("E003", "limits", "must be a Limits instance"))
        if not found:
            found.extend(self._guarantee_problems())
        return found

    def _guarantee_problems(self) -> list[Problem]:
        """Producer settings that would break per-key order (E014)."""
        merged = {**self.base_kafka_config, **self.producer_kafka_config}
        acks = str(merged.get("acks", merged.get("request.required.acks", "all"))).lower()
        rules = [
            (str(merged.get("enable.idempotence", True)).lower() in {"false", "0"},
             "enable.idempotence must stay true: without it librdkafka's retries can reorder a key's records"),
            (acks not in {"all", "-1"}, f"acks must stay 'all' (got {acks!r}): the idempotent producer needs it"),
            *((self.limits.max_in_flight_per_key > 1 and key in merged,
               f"{key} must not be set when max_in_flight_per_key > 1: the engine sets it so a key's records reach "
               f"Kafka without holes (use the delivery_timeout limit instead, or set max_in_flight_per_key to 1)")
              for key in ("enable.gapless.guarantee", "delivery.timeout.ms", "message.timeout.ms")),
        ]
        return [Problem("E014", "producer_kafka_config", why) for broken, why in rules if broken]

    def warnings(self) -> list[Problem]:
        """Settings that work but weaken a guarantee (call on a config that validates)."""
        merged = {**self.base_kafka_config, **self.producer_kafka_config}
        field_name, delivery = "delivery_timeout", self.limits.delivery_timeout
        for name in ("delivery.timeout.ms", "message.timeout.ms"):
            if name in merged and is_number(given := _number(merged[name])):
                field_name, delivery = "producer_kafka_config", given / 1000
        heartbeat = self.limits.heartbeat_timeout
        session = 3 * heartbeat
        rules = [
            (heartbeat < MIN_HEARTBEAT_TIMEOUT, "W007", "heartbeat_timeout",
             f"{heartbeat:g}s gives the leader group a session timeout of {session:g}s (3 x heartbeat_timeout), "
             f"under the 6s Kafka's brokers accept by default (group.min.session.timeout.ms): unless the brokers' "
             f"minimum is lowered, the harvester stops at start with Kafka's refusal"),
            (heartbeat + delivery >= session, "W001", field_name,
             f"the delivery timeout ({delivery:g}s) plus heartbeat_timeout ({heartbeat:g}s) should stay below the "
             f"leader session timeout ({session:g}s, 3 x heartbeat_timeout): a fenced leader's last records could "
             f"otherwise land after a new leader has started"),
        ]
        return [Problem(code, name, why) for broken, code, name, why in rules if broken]

    def redacted(self) -> dict[str, Any]:
        """The effective configuration as plain data, with passwords and secrets masked, the limits last (`shard` is
        each engine's own, set by the sharded harvester, not configuration)."""
        shown = {spec.name: getattr(self, spec.name) for spec in dataclasses.fields(self)
                 if spec.name not in ("shard", "limits")}
        return {**shown, "dsn": redact_dsn(self.dsn),
                **{name: redact_mapping(shown[name]) for name in ("base_kafka_config", "producer_kafka_config")},
                "limits": dataclasses.asdict(self.limits)}

    def __repr__(self) -> str:  # never let a password reach a log line through repr()
        return f"HarvestConfig({self.redacted()!r})"


#: HarvestConfig's fields a user sets by name (OUTBOX in Django, the stand-alone harvester's TOML file), besides the
#: limits: those with a meaning; dsn, shard and the dead-letter table's name come other ways.
SETTING_KEYS = tuple(spec.name for spec in dataclasses.fields(HarvestConfig) if "doc" in spec.metadata)


def from_values(values: Mapping[str, Any], *, dsn: str, derived_leader: str, environ: Mapping[str, str],
                given_by: str) -> tuple[HarvestConfig, set[str], str | None]:
    """The engine's config from settings by name (OUTBOX's keys and `manage.py harvest`'s flags, or the stand-alone
    harvester's file and flags), the database's DSN and the environment; with the limits the user gave, and where
    bootstrap.servers came from (None: nowhere, W006). The leader topic and group are derived where absent (an empty
    one is the user's, and refused)."""
    given = {name for name in LIMIT_NAMES if name in values}
    limits = Limits(**{name: seconds(values[name]) for name in given})
    engine = {name: seconds(values[name]) for name in SETTING_KEYS if name in values}
    source = None
    if isinstance(engine.get("base_kafka_config", {}), Mapping):
        engine["base_kafka_config"], source = bootstrap(engine.get("base_kafka_config", {}), environ, given_by)
    for name in ("leader_topic", "leader_group"):
        if engine.get(name) is None:
            engine[name] = derived_leader
    return HarvestConfig(dsn=dsn, limits=limits, **engine), given, source


def leader_name(host: str | None, port: str | int | None, dbname: str | None, table: str,
                options: str | None = None) -> str:
    """The leader topic and group when the settings do not name them: one per database and table, so two
    outboxes sharing a Kafka cluster never share a group (which would leave one unharvested). Django's
    settings and the stand-alone harvester's DSN derive the same name for the same database. An unqualified
    table is taken to be in the first schema of the search_path libpq's `options` set (`-c search_path=billing`),
    else in `public`: the name of `outbox` reached through `search_path=billing` is `billing.outbox`'s. A
    search_path set elsewhere (the role, the database, PGOPTIONS) is not seen here: the engine warns at start when
    its table is in another schema than the name says (connector.py)."""
    schema = None if "." in table else first_schema(options)
    table = f"{schema}.{table}" if schema not in (None, "public") else table
    where = f"{host or 'localhost'}:{port or 5432}/{dbname or ''}/{table}"
    readable = re.sub(r"[^a-zA-Z0-9._-]", "_", f"{dbname or 'db'}.{table}")[:180]
    return f"outbox-leader.{readable}.{hashlib.sha1(where.encode()).hexdigest()[:8]}"


def derived_leader_name(dsn: str, table: Any) -> str:
    """leader_name() of a libpq connection string or URL (what `outbox-harvest` and the engine know)."""
    info = _conninfo(dsn)
    return leader_name(info.get("host"), info.get("port"), info.get("dbname"), table if isinstance(table, str)
                       else "outbox", info.get("options"))


def assumed_schema(dsn: str) -> str:
    """The schema derived_leader_name() takes an unqualified table of `dsn` to be in."""
    return first_schema(_conninfo(dsn).get("options")) or "public"


def _conninfo(dsn: str) -> dict[str, Any]:
    """`dsn`'s parameters ({} for none, or for one libpq cannot parse: its check says so, naming no secret)."""
    try:
        return conninfo_to_dict(dsn) if dsn else {}
    except psycopg.ProgrammingError:
        return {}


#: `-c search_path=...` (or `--search-path=...`) in libpq's options: Postgres takes `-` for `_` and any case.
_SEARCH_PATH = re.compile(r"(?:-c\s*|--)search[_-]path=((?:\\.|\S)+)", re.IGNORECASE)


def first_schema(options: Any) -> str | None:
    """The first schema of the search_path a libpq `options` string sets, as Postgres reads the name (unquoted:
    lower case; "quoted": as written), or None (none set, or `$user`, whose schema depends on the role)."""
    found = _SEARCH_PATH.search(options) if isinstance(options, str) else None
    if found is None:
        return None
    first = re.sub(r"\\(.)", r"\1", found.group(1)).split(",")[0].strip()
    if len(first) >= 2 and first[0] == first[-1] == '"':
        return first[1:-1].replace('""', '"') or None
    return None if not first or first == "$user" else first.lower()
