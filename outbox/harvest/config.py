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

from outbox.harvest.sharding import shards_problem
from outbox.kafka.names import MAX_TOPIC_LENGTH, TOPIC_PATTERN, default_name, name_problem
from outbox.kafka.problems import Problem
from outbox.kafka.redaction import redact_dsn, redact_mapping

# An unquoted SQL identifier, optionally schema-qualified: [schema.]table.
TABLE_PATTERN = re.compile(r"(?:[A-Za-z_][A-Za-z0-9_$]{0,62}\.)?[A-Za-z_][A-Za-z0-9_$]{0,62}")
#: HarvestConfig fields a user sets by name (OUTBOX in Django, the stand-alone harvester's TOML file), besides the
#: limits; dsn, shard and the dead-letter and status tables' names come other ways.
SETTING_KEYS = ("table", "base_kafka_config", "producer_kafka_config", "leader_topic", "leader_group", "name",
                "listen", "status_table", "status_prune_after", "history_retention", "dead_letter_topic",
                "dead_letter_retention", "park_after", "shards")


def limit(default: float | int | None, minimum: float | str, doc: str, maximum: float | None = None) -> Any:
    """A Limits field: its default, the least value it accepts (or the name of the field that is
    its least value), the most (if any), and what it does."""
    return field(default=default, metadata={"minimum": minimum, "maximum": maximum, "doc": doc})


#: The limits whose default is derived from others (Limits.__post_init__), and those others: a problem is
#: reported on the limit the user set, not again on each limit derived from it.
DERIVED_FROM = {"max_poll_interval": ("heartbeat_timeout",),
                "drain_interval": ("heartbeat_timeout", "max_poll_interval", "queue_timeout"),
                "delivery_timeout": ("heartbeat_timeout",)}


@dataclass(frozen=True)
class Limits:
    """Timing and sizing limits, in seconds and counts; goharvest's names where goharvest has one."""

    io_error_backoff: float = limit(0.5, 0.0, "Pause after a failed database or Kafka call before trying again.")
    min_poll_interval: float = limit(0.1, 0.001, "The leader topic is polled at least this often, so Kafka sees "
                                                 "the replica alive.")
    heartbeat_timeout: float = limit(5.0, 0.001, "A leader fences itself when it has not seen its own heartbeat "
                                                 "for this long; Kafka's session timeout is three times it.",
                                     maximum=1200.0)
    max_poll_interval: float | None = limit(None, "min_poll_interval",
                                            "Longest gap between polls of the leader topic before the leader "
                                            "re-marks (default: heartbeat_timeout / 2).")
    drain_interval: float | None = limit(None, 0.001, "Longest sleep of the engine between checks of its "
                                                      "deadlines (default: min(max_poll_interval, queue_timeout)).")
    queue_timeout: float = limit(30.0, 0.001, "A marked record waiting longer than this to be sent forces a "
                                              "re-mark.")
    delivery_timeout: float | None = limit(None, 0.001, "A record not acknowledged by Kafka within this long is "
                                                        "given up and re-marked (default: 1.5 x "
                                                        "heartbeat_timeout, so a fenced leader's last records "
                                                        "cannot land after a new leader has started).")
    mark_backoff: float = limit(0.01, 0.0, "Pause after a mark that found no more rows, when nothing wakes the "
                                           "leader (LISTEN off, or the table has no NOTIFY trigger).")
    idle_poll_interval: float = limit(1.0, 0.001, "Safety-net poll of an idle leader whose table's trigger "
                                                  "wakes it with NOTIFY.")
    # Defaults measured on a stock Postgres (docs/tuning.md, "Choosing the limits").
    max_in_flight_records: int = limit(4000, 1, "At most this many records are sent and not yet acknowledged "
                                                "and purged.")
    max_in_flight_per_key: int = limit(256, 1, "At most this many records of one key in flight at once (1 is "
                                               "goharvest's barrier; more pipelines hot keys, see "
                                               "docs/guarantees.md).")
    mark_query_records: int = limit(1000, 1, "Rows marked by one mark query.")
    purge_interval: float = limit(0.01, 0.0, "Purges are coalesced: at most one statement this often, deleting every "
                                             "record acknowledged meanwhile (a key's slot frees a little later).")
    purge_delay: float = limit(0.1, 0.0, "Acknowledged records that nothing waits on (no record of their key, the "
                                         "throttle, a stop or a revoke) are purged together, at most this long "
                                         "after the first of them was acknowledged: one DELETE for many wakes at "
                                         "a steady rate, which costs the database a tenth of the purges' CPU "
                                         "(docs/benchmarks.md, issue 28). 0: every purge_interval.")
    held_check_interval: float = limit(1.0, 0.001, "How often a leader re-reads its held (poison) rows, so a "
                                                   "fix, a deletion or an operator's retry is seen at once.")
    held_retry_after: float = limit(60.0, 0.001, "A held record is tried again after this long (doubling each "
                                                 "time, up to 16 times it), in case its cause went away.")
    fence_retry_interval: float = limit(5.0, 0.001, "How often a leader blocked by another replica's database "
                                                    "fence tries to take it.")
    topic_limits_interval: float = limit(60.0, 0.001, "How often each topic's max.message.bytes is read again "
                                                      "from Kafka (the record producer's batches fit the smallest; "
                                                      "a record that cannot fit is held before it is produced).")
    min_metrics_interval: float = limit(5.0, 0.0, "Throughput is measured (and logged, when it moved) at most "
                                                  "this often.")
    status_interval: float = limit(2.0, 0.0, "The replica's status row is written this often (0 turns status "
                                             "rows off).")
    history_interval: float = limit(10.0, 0.0, "A sample of the replica's figures is added to the history (the "
                                               "dashboard's charts) this often, with its status row (0 turns "
                                               "history off).")

    def __post_init__(self) -> None:
        # Derived defaults, as goharvest's SetDefaults; left unset when their inputs are bad so
        # that problems() reports the input rather than this raising.
        if self.max_poll_interval is None and _is_number(self.heartbeat_timeout):
            object.__setattr__(self, "max_poll_interval", self.heartbeat_timeout / 2)
        if self.drain_interval is None and _is_number(self.max_poll_interval) and _is_number(self.queue_timeout):
            object.__setattr__(self, "drain_interval", min(self.max_poll_interval, self.queue_timeout))
        if self.delivery_timeout is None and _is_number(self.heartbeat_timeout):
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
                minimum = getattr(self, minimum) if _is_number(getattr(self, minimum)) else 0.001
            integral = spec.type == "int"
            if isinstance(value, bool) or not (_is_int(value) if integral else _is_number(value)):
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


@dataclass(frozen=True)
class HarvestConfig:
    """Everything a Harvester needs. Build it, call validate(), then hand it over."""

    #: libpq connection string or URL for the database holding the outbox table (may carry a password).
    dsn: str
    table: str = "outbox"
    #: librdkafka settings shared by every client (bootstrap.servers, security.protocol, sasl.*).
    base_kafka_config: Mapping[str, Any] = field(default_factory=lambda: {"bootstrap.servers": "localhost:9092"})
    #: librdkafka settings for the outbox producer only (compression.type, linger.ms, ...).
    producer_kafka_config: Mapping[str, Any] = field(default_factory=dict)
    leader_topic: str = "outbox-harvest"
    leader_group: str = "outbox-harvest"
    name: str = field(default_factory=default_name)
    limits: Limits = field(default_factory=Limits)
    #: LISTEN for stash()'s NOTIFY so committed records are picked up at once.
    listen: bool = True
    #: Table of replica status rows (None: do not report); skipped if it does not exist.
    status_table: str | None = "outbox_harvester"
    #: Status rows not seen for this long (seconds) are deleted.
    status_prune_after: float = 3600.0
    #: History samples (the `<status_table>_history` table, the dashboard's charts) older than this
    #: (seconds) are deleted.
    history_retention: float = 86400.0
    #: Where parked (dead-letter) records go; parking is off if it does not exist.
    dead_letter_table: str | None = "outbox_dead_letter"
    #: Also publish parked records here (None: the table only).
    dead_letter_topic: str | None = None
    #: Parked records older than this (seconds) are deleted (None: kept until an operator acts).
    dead_letter_retention: float | None = 30 * 86400.0
    #: Park a held record after it failed this many times on its own (None: hold it until an
    #: operator acts; holding keeps its key's order, parking trades it for liveness).
    park_after: int | None = None
    #: The table's rows are harvested in this many shards, each led by its own leader (sharding.py,
    #: shards.py); 1 is goharvest's one leader per table.
    shards: int = 1
    #: Which shard this engine harvests (0 to shards - 1); set by the sharded harvester for each of its engines.
    shard: int = 0

    def for_shard(self, shard: int) -> HarvestConfig:
        """The config of this replica's engine for one shard."""
        return dataclasses.replace(self, shard=shard)

    def validate(self, *, given_limits: Collection[str] | None = None) -> list[Problem]:
        """Every problem at once; an empty list means the config is usable.

        `given_limits` names the limits set explicitly (see Limits.problems)."""
        found: list[Problem] = []
        if not isinstance(self.dsn, str) or not self.dsn.strip():
            found.append(Problem("E005", "dsn", "must name the database holding the outbox table"))
        if not isinstance(self.table, str) or not TABLE_PATTERN.fullmatch(self.table):
            found.append(Problem("E006", "table",
                                 f"must be an SQL identifier, optionally schema.table (at most 63 characters each), "
                                 f"got {self.table!r}"))
        for name in ("leader_topic",):
            value = getattr(self, name)
            if not isinstance(value, str) or not TOPIC_PATTERN.fullmatch(value) or value in {".", ".."}:
                found.append(Problem("E007", name,
                                     f"must be a Kafka topic name (1-{MAX_TOPIC_LENGTH} of a-z A-Z 0-9 . _ -), "
                                     f"got {value!r}"))
        for name in ("leader_group", "name"):
            problem = name_problem(getattr(self, name))
            if problem is not None:
                found.append(Problem("E008", name, problem))
        for name in ("base_kafka_config", "producer_kafka_config"):
            value = getattr(self, name)
            if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
                found.append(Problem("E009", name, "must be a mapping of librdkafka property names to values"))
        if isinstance(self.base_kafka_config, Mapping) and not self.base_kafka_config.get("bootstrap.servers"):
            found.append(Problem("E010", "base_kafka_config", "must set bootstrap.servers"))
        for name in ("status_table", "dead_letter_table"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not TABLE_PATTERN.fullmatch(value)):
                found.append(Problem("E006", name, f"must be an SQL identifier or None, got {value!r}"))
        topic = self.dead_letter_topic
        if topic is not None and (not isinstance(topic, str) or not TOPIC_PATTERN.fullmatch(topic)
                                  or topic in {".", ".."}):
            found.append(Problem("E007", "dead_letter_topic",
                                 f"must be a Kafka topic name (1-{MAX_TOPIC_LENGTH} of a-z A-Z 0-9 . _ -) or None, "
                                 f"got {topic!r}"))
        if self.park_after is not None and (not _is_int(self.park_after) or self.park_after < 1):
            found.append(Problem("E004", "park_after", f"must be a positive integer or None, got {self.park_after!r}"))
        if not _is_number(self.status_prune_after) or self.status_prune_after <= 0:
            found.append(Problem("E004", "status_prune_after", f"must be a positive number of seconds, "
                                                               f"got {self.status_prune_after!r}"))
        if not _is_number(self.history_retention) or self.history_retention <= 0:
            found.append(Problem("E004", "history_retention", f"must be a positive number of seconds, "
                                                              f"got {self.history_retention!r}"))
        retention = self.dead_letter_retention
        if retention is not None and (not _is_number(retention) or retention <= 0):
            found.append(Problem("E004", "dead_letter_retention", f"must be a positive number of seconds or None, "
                                                                  f"got {retention!r}"))
        if not isinstance(self.listen, bool):
            found.append(Problem("E003", "listen", f"must be True or False, got {self.listen!r}"))
        if (problem := shards_problem(self.shards)) is not None:
            found.append(Problem("E017", "shards", problem))
        elif not _is_int(self.shard) or not 0 <= self.shard < self.shards:
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
        found = []
        merged = {**self.base_kafka_config, **self.producer_kafka_config}
        if str(merged.get("enable.idempotence", True)).lower() in {"false", "0"}:
            found.append(Problem("E014", "producer_kafka_config", "enable.idempotence must stay true: without it "
                                                                  "librdkafka's retries can reorder a key's records"))
        acks = str(merged.get("acks", merged.get("request.required.acks", "all"))).lower()
        if acks not in {"all", "-1"}:
            found.append(Problem("E014", "producer_kafka_config", f"acks must stay 'all' (got {acks!r}): the "
                                                                  f"idempotent producer needs it"))
        if self.limits.max_in_flight_per_key > 1:
            for key in ("enable.gapless.guarantee", "delivery.timeout.ms", "message.timeout.ms"):
                if key in merged:
                    found.append(Problem("E014", "producer_kafka_config",
                                         f"{key} must not be set when max_in_flight_per_key > 1: the engine sets it "
                                         f"so a key's records reach Kafka without holes (use the delivery_timeout "
                                         f"limit instead, or set max_in_flight_per_key to 1)"))
        return found

    def warnings(self) -> list[Problem]:
        """Settings that work but weaken a guarantee (call on a config that validates)."""
        found = []
        merged = {**self.base_kafka_config, **self.producer_kafka_config}
        field_name, delivery = "delivery_timeout", self.limits.delivery_timeout
        for key in ("delivery.timeout.ms", "message.timeout.ms"):
            if key in merged:
                try:
                    field_name, delivery = "producer_kafka_config", float(merged[key]) / 1000
                except (TypeError, ValueError):
                    pass
        heartbeat = self.limits.heartbeat_timeout
        session = 3 * heartbeat
        if heartbeat + delivery >= session:
            found.append(Problem(
                "W001", field_name,
                f"the delivery timeout ({delivery:g}s) plus heartbeat_timeout ({heartbeat:g}s) should stay below "
                f"the leader session timeout ({session:g}s, 3 x heartbeat_timeout): a fenced leader's last records "
                f"could otherwise land after a new leader has started"))
        return found

    def redacted(self) -> dict[str, Any]:
        """The effective configuration as plain data, with passwords and secrets masked."""
        return {
            "dsn": redact_dsn(self.dsn),
            "table": self.table,
            "base_kafka_config": redact_mapping(self.base_kafka_config),
            "producer_kafka_config": redact_mapping(self.producer_kafka_config),
            "leader_topic": self.leader_topic,
            "leader_group": self.leader_group,
            "name": self.name,
            "listen": self.listen,
            "status_table": self.status_table,
            "status_prune_after": self.status_prune_after,
            "history_retention": self.history_retention,
            "dead_letter_table": self.dead_letter_table,
            "dead_letter_topic": self.dead_letter_topic,
            "dead_letter_retention": self.dead_letter_retention,
            "park_after": self.park_after,
            "shards": self.shards,
            "limits": dataclasses.asdict(self.limits),
        }

    def __repr__(self) -> str:  # never let a password reach a log line through repr()
        return f"HarvestConfig({self.redacted()!r})"


def leader_name(host: str | None, port: str | int | None, dbname: str | None, table: str) -> str:
    """The leader topic and group when the settings do not name them: one per database and table, so two
    outboxes sharing a Kafka cluster never share a group (which would leave one unharvested). Django's
    settings and the stand-alone harvester's DSN derive the same name for the same database."""
    where = f"{host or 'localhost'}:{port or 5432}/{dbname or ''}/{table}"
    readable = re.sub(r"[^a-zA-Z0-9._-]", "_", f"{dbname or 'db'}.{table}")[:180]
    return f"outbox-leader.{readable}.{hashlib.sha1(where.encode()).hexdigest()[:8]}"


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value  # NaN fails


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
