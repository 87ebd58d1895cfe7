"""The harvester's configuration: one frozen object, defaults in one place, one validate().

Durations are seconds (floats), as in Django's own settings. Names follow
goharvest's limits in snake_case. Nothing here imports Django.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Kafka's own rule for topic names: 1..249 of [a-zA-Z0-9._-], and not "." or "..".
TOPIC_PATTERN = re.compile(r"[a-zA-Z0-9._-]{1,249}")
MAX_TOPIC_LENGTH = 249
# An unquoted SQL identifier, optionally schema-qualified: [schema.]table.
TABLE_PATTERN = re.compile(r"(?:[A-Za-z_][A-Za-z0-9_$]{0,62}\.)?[A-Za-z_][A-Za-z0-9_$]{0,62}")
# Kafka config keys whose values must never be printed or logged.
SECRET_KEY_PATTERN = re.compile(r"password|secret|token|jaas|credential|private", re.IGNORECASE)
REDACTED = "***"


def default_name() -> str:
    """A replica name that is unique enough: host, pid and start second (as goharvest)."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname() or "localhost")
    return f"{host}_{os.getpid()}_{int(time.time())}"


@dataclass(frozen=True)
class Limits:
    """Timing and sizing limits; goharvest's names and defaults, in seconds."""

    #: Pause after a failed database or Kafka call before trying again.
    io_error_backoff: float = 0.5
    #: The consumer is polled at least this often while leading, so Kafka sees it alive.
    min_poll_interval: float = 0.1
    #: Leader fences itself when it has not seen its own heartbeat for this long.
    heartbeat_timeout: float = 5.0
    #: Longest gap between polls of the leader topic before the pipeline is reset (default: heartbeat_timeout / 2).
    max_poll_interval: float | None = None
    #: Longest wait on one condition (throttle or key barrier) before deadlines are rechecked
    #: (default: min(max_poll_interval, queue_timeout)).
    drain_interval: float | None = None
    #: A marked record waiting longer than this to be sent forces a remark.
    queue_timeout: float = 30.0
    #: Pause after a mark query that found nothing (cut short by a NOTIFY when listening).
    mark_backoff: float = 0.01
    #: At most this many records are sent and not yet acknowledged and purged.
    max_in_flight_records: int = 1000
    #: Rows marked by one mark query.
    mark_query_records: int = 100
    #: Throughput is logged and signalled at most this often.
    min_metrics_interval: float = 5.0
    #: The replica's status row is written this often (0 turns status rows off).
    status_interval: float = 2.0

    def __post_init__(self) -> None:
        # Derived defaults, as goharvest's SetDefaults; left unset when their inputs are bad so
        # that problems() reports the input rather than this raising.
        if self.max_poll_interval is None and _is_number(self.heartbeat_timeout):
            object.__setattr__(self, "max_poll_interval", self.heartbeat_timeout / 2)
        if self.drain_interval is None and _is_number(self.max_poll_interval) and _is_number(self.queue_timeout):
            object.__setattr__(self, "drain_interval", min(self.max_poll_interval, self.queue_timeout))

    def problems(self) -> list[Problem]:
        found = []
        minimums: dict[str, float] = {
            "io_error_backoff": 0.0,
            "min_poll_interval": 0.001,
            "heartbeat_timeout": 0.001,
            "max_poll_interval": self.min_poll_interval if _is_number(self.min_poll_interval) else 0.001,
            "drain_interval": 0.001,
            "queue_timeout": 0.001,
            "mark_backoff": 0.0,
            "max_in_flight_records": 1,
            "mark_query_records": 1,
            "min_metrics_interval": 0.0,
            "status_interval": 0.0,
        }
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            minimum = minimums[spec.name]
            integral = spec.type == "int"
            if isinstance(value, bool) or not (_is_int(value) if integral else _is_number(value)):
                kind = "an integer" if integral else "a number of seconds"
                found.append(Problem("E003", spec.name, f"must be {kind}, got {value!r}"))
            elif value < minimum:
                found.append(Problem("E004", spec.name, f"must be at least {minimum:g}, got {value!r}"))
        return found


@dataclass(frozen=True)
class Problem:
    """One configuration problem: a stable code, the setting it concerns, and why."""

    code: str
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


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

    @property
    def channel(self) -> str:
        """The NOTIFY channel that stash() signals for this table."""
        return notify_channel(self.table)

    def validate(self) -> list[Problem]:
        """Every problem at once; an empty list means the config is usable."""
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
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                found.append(Problem("E008", name, f"must be a non-empty string, got {value!r}"))
        for name in ("base_kafka_config", "producer_kafka_config"):
            value = getattr(self, name)
            if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
                found.append(Problem("E009", name, "must be a mapping of librdkafka property names to values"))
        if isinstance(self.base_kafka_config, Mapping) and not self.base_kafka_config.get("bootstrap.servers"):
            found.append(Problem("E010", "base_kafka_config", "must set bootstrap.servers"))
        if self.status_table is not None and (not isinstance(self.status_table, str)
                                              or not TABLE_PATTERN.fullmatch(self.status_table)):
            found.append(Problem("E006", "status_table",
                                 f"must be an SQL identifier or None, got {self.status_table!r}"))
        if not _is_number(self.status_prune_after) or self.status_prune_after <= 0:
            found.append(Problem("E004", "status_prune_after", f"must be a positive number of seconds, "
                                                               f"got {self.status_prune_after!r}"))
        if not isinstance(self.listen, bool):
            found.append(Problem("E003", "listen", f"must be True or False, got {self.listen!r}"))
        if isinstance(self.limits, Limits):
            found.extend(self.limits.problems())
        else:
            found.append(Problem("E003", "limits", "must be a Limits instance"))
        return found

    def warnings(self) -> list[Problem]:
        """Settings that work but weaken a guarantee."""
        found = []
        timeout = self.producer_kafka_config.get("delivery.timeout.ms",
                                                 self.base_kafka_config.get("delivery.timeout.ms"))
        if _is_number(self.limits.heartbeat_timeout) and timeout is not None:
            try:
                delivery = float(timeout) / 1000
            except (TypeError, ValueError):
                delivery = None
            session = 3 * self.limits.heartbeat_timeout
            if delivery is not None and self.limits.heartbeat_timeout + delivery >= session:
                found.append(Problem(
                    "W001", "producer_kafka_config",
                    f"delivery.timeout.ms ({delivery:g}s) plus heartbeat_timeout ({self.limits.heartbeat_timeout:g}s) "
                    f"should stay below the leader session timeout ({session:g}s, 3 x heartbeat_timeout): a fenced "
                    f"leader's last records could otherwise land after a new leader has started"))
        return found

    def redacted(self) -> dict[str, Any]:
        """The effective configuration as plain data, with passwords and secrets masked."""
        return {
            "dsn": redact_dsn(self.dsn),
            "table": self.table,
            "base_kafka_config": redact_kafka_config(self.base_kafka_config),
            "producer_kafka_config": redact_kafka_config(self.producer_kafka_config),
            "leader_topic": self.leader_topic,
            "leader_group": self.leader_group,
            "name": self.name,
            "listen": self.listen,
            "status_table": self.status_table,
            "status_prune_after": self.status_prune_after,
            "limits": dataclasses.asdict(self.limits),
        }

    def __repr__(self) -> str:  # never let a password reach a log line through repr()
        return f"HarvestConfig({self.redacted()!r})"


def notify_channel(table: str) -> str:
    return f"outbox:{table}"


def redact_kafka_config(config: Mapping[str, Any]) -> dict[str, Any]:
    return {key: (REDACTED if SECRET_KEY_PATTERN.search(key) else value) for key, value in dict(config).items()}


_URL_PASSWORD = re.compile(r"(?P<head>^[a-z][a-z0-9+.-]*://[^:/@]*:)(?P<password>[^@]*)(?P<tail>@)", re.IGNORECASE)
_KV_PASSWORD = re.compile(r"(?P<head>\bpassword\s*=\s*)(?P<password>'(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def redact_dsn(dsn: str) -> str:
    """Mask the password in a URL (postgres://u:pw@h/db) or key=value (password=pw) connection string."""
    if not isinstance(dsn, str):
        return REDACTED
    dsn = _URL_PASSWORD.sub(lambda m: f"{m['head']}{REDACTED}{m['tail']}", dsn)
    return _KV_PASSWORD.sub(lambda m: f"{m['head']}{REDACTED}", dsn)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value  # NaN fails


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
