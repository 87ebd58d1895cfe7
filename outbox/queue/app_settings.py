"""OUTBOX["queues"] (and the environment) to the queue's one frozen QueueConfig.

    OUTBOX = {
        "base_kafka_config": {"bootstrap.servers": "kafka:9092"},   # shared with the harvester
        "queues": {
            "redelivery_timeout": 30,
            "max_deliveries": 5,
            "per_queue": {"reports": {"redelivery_timeout": 600, "max_in_progress": 1}},
        },
    }

Every key is known here: a typo is a system-check error (outbox_queue.E002), not a silent default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django.conf import settings

from outbox.kafka.problems import Problem, unknown_keys
from outbox.queue.config import LIMIT_NAMES, QueueConfig, QueueLimits

#: Defaults of every OUTBOX["queues"] key that is not a per-queue limit (those default in QueueLimits).
DEFAULTS: dict[str, Any] = {
    "topic": None,  # "<project>-queue"
    "markers_topic": None,  # "<project>-queue-markers"
    "partitions": 8,
    "markers_partitions": 4,
    "consumer_group_prefix": None,  # "<project>-queue-"
    "tracker_group": None,  # "<project>-queue-tracker"
    "per_queue": {},
    "poll_interval": 0.1,
    # Status rows of consumers and trackers (the admin's queue pages).
    "status_interval": 2.0,
    "status_gone_after": 20.0,
    # A tracker adds a sample per queue to the history (the queue pages' charts) this often (0: never)...
    "history_interval": 10.0,
    # ...and deletes samples older than this.
    "history_retention": 24 * 3600.0,
    # Inbox rows (manage.py outbox_consume --inbox) older than this are deleted.
    "inbox_retention": 7 * 24 * 3600.0,
    # Dead letters older than this are deleted by the trackers (None: kept until an operator acts).
    "dead_letter_retention": 30 * 24 * 3600.0,
}
#: What each OUTBOX["queues"] key does, with its default as the reference shows it (docs/reference/settings.md).
MEANINGS: dict[str, tuple[str, str]] = {
    "topic": ("`\"<project>-queue\"`",
        "the queue topic, shared by every logical queue"),
    "markers_topic": ("`\"<project>-queue-markers\"`",
        "the markers topic"),
    "partitions": ("`8`",
        "partition counts when the topics are created"),
    "markers_partitions": ("`4`",
        "partition counts when the topics are created"),
    "consumer_group_prefix": ("`\"<project>-queue-\"`",
        "consumers of queue Q share group `<prefix>Q`"),
    "tracker_group": ("`\"<project>-queue-tracker\"`",
        "the trackers' consumer group"),
    "redelivery_timeout": ("`30`",
        "seconds without a marker before a message is redelivered (0.1 to 43,200)"),
    "keep_alive_interval": ("`redelivery_timeout / 3`",
        "must be below the timeout; above half of it is warning `outbox_queue.W001`"),
    "max_in_progress": ("`10`",
        "messages a consumer holds at once (back-pressure; also its Start transaction's largest batch)"),
    "max_deliveries": ("`5`",
        "deliveries before a message becomes a dead letter; `None`: no limit"),
    "backend": ("`\"markers\"`",
        "`\"markers\"` (this page) or `\"share\"` (Kafka's share groups, 4.2+): "
        "[queue-backends.md](../queue-backends.md)"),
    "per_queue": ("`{}`",
        "`{\"reports\": {\"redelivery_timeout\": 600, \"max_in_progress\": 1}}`: the four limits and the "
        "backend above, per queue"),
    "poll_interval": ("`0.1`",
        "longest wait of a consumer's or tracker's loop"),
    "status_interval": ("`2`",
        "status rows (admin) are written this often"),
    "status_gone_after": ("`20`",
        "admin calls a process not seen for this long gone"),
    "inbox_retention": ("`604800`",
        "inbox rows older than this (seconds) are pruned"),
    "history_interval": ("`10`",
        "a tracker adds a sample per queue (in progress, redeliveries, dead letters) to `outbox_queue_history`, the "
        "admin's charts, this often, with its status row (0: never)"),
    "history_retention": ("`86400`",
        "samples older than this (seconds) are deleted"),
    "dead_letter_retention": ("`2592000`",
        "dead letters written longer ago than this (30 days) are deleted by the trackers, once a minute; `None` "
        "keeps them until an operator acts"),
}
#: What each check code of OUTBOX["queues"] means (docs/reference/settings.md is written from it).
CHECK_CODES: dict[str, str] = {
    "outbox_queue.E001": "`OUTBOX['queues']` is not a dict",
    "outbox_queue.E002": "an unknown key (with a \"did you mean\")",
    "outbox_queue.E003": "a value of the wrong type (`per_queue` not a dict of dicts, a group prefix not a string, "
        "`base_kafka_config` without `bootstrap.servers`)",
    "outbox_queue.E004": "a value outside its range",
    "outbox_queue.E005": "a bad topic name, or the markers topic the same as the queue topic",
    "outbox_queue.E006": "a bad queue name in `per_queue`",
    "outbox_queue.E007": "a setting the queue's backend cannot honour (an unknown `backend`; the share backend's "
        "limits on `redelivery_timeout` and `max_deliveries`)",
    "outbox_queue.W001": "`keep_alive_interval` above half the redelivery timeout: one late marker redelivers a "
        "message still in hand",
}
KNOWN_KEYS = frozenset(DEFAULTS) | frozenset(LIMIT_NAMES)
DEFAULT_BOOTSTRAP_SERVERS = "localhost:9092"
_SECONDS = {"redelivery_timeout", "keep_alive_interval", "poll_interval", "status_interval", "status_gone_after",
            "inbox_retention", "history_interval", "history_retention", "dead_letter_retention"}


def raw_settings() -> Any:
    value = _outbox().get("queues", {})
    return {} if value is None else value


def _outbox() -> Mapping[str, Any]:
    outbox = getattr(settings, "OUTBOX", {})
    return outbox if isinstance(outbox, Mapping) else {}


def base_kafka_config() -> dict[str, Any]:
    """OUTBOX["base_kafka_config"], shared with the harvester; bootstrap.servers falls back to the environment."""
    base = _outbox().get("base_kafka_config") or {}
    base = dict(base) if isinstance(base, Mapping) else {}
    base.setdefault("bootstrap.servers", os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or DEFAULT_BOOTSTRAP_SERVERS)
    return base


def project_name() -> str:
    module = os.environ.get("DJANGO_SETTINGS_MODULE") or getattr(settings, "SETTINGS_MODULE", None) or "django"
    return module.split(".")[0]


def setting(name: str) -> Any:
    """One OUTBOX["queues"] value with its default (durations in seconds)."""
    raw = raw_settings()
    return _seconds(raw.get(name, DEFAULTS[name]) if isinstance(raw, Mapping) else DEFAULTS[name])


def problems() -> list[Problem]:
    """Everything wrong with OUTBOX["queues"], for `manage.py check`."""
    raw = raw_settings()
    if not isinstance(raw, Mapping):
        return [Problem("E001", "OUTBOX['queues']", f"must be a dict, got {type(raw).__name__}")]
    found = unknown_keys(raw, KNOWN_KEYS)
    per_queue = raw.get("per_queue", {})
    if not isinstance(per_queue, Mapping):
        found.append(Problem("E003", "per_queue", f"must be a dict of queue name to limits, got {per_queue!r}"))
    else:
        for queue, limits in per_queue.items():
            if not isinstance(limits, Mapping):
                found.append(Problem("E003", f"per_queue[{queue!r}]", f"must be a dict of limits, got {limits!r}"))
            else:
                found.extend(unknown_keys(limits, LIMIT_NAMES, f"per_queue[{queue!r}]."))
    for key in ("status_interval", "status_gone_after", "inbox_retention", "history_retention"):
        value = setting(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            found.append(Problem("E004", key, f"must be a positive number of seconds, got {value!r}"))
    retention = setting("dead_letter_retention")
    if retention is not None and (isinstance(retention, bool) or not isinstance(retention, int | float)
                                  or retention <= 0):
        found.append(Problem("E004", "dead_letter_retention",
                             f"must be a positive number of seconds or None, got {retention!r}"))
    interval = setting("history_interval")
    if isinstance(interval, bool) or not isinstance(interval, int | float) or interval < 0:
        found.append(Problem("E004", "history_interval", f"must be a number of seconds, 0 or more, got {interval!r}"))
    if found:
        return found
    try:
        config = queue_config()
    except (TypeError, ValueError) as error:  # a value too malformed to build the config from
        return [Problem("E003", "OUTBOX['queues']", str(error))]
    return config.validate()


def warnings() -> list[Problem]:
    if problems():
        return []
    return queue_config().warnings()


def queue_config(**overrides: Any) -> QueueConfig:
    """The queue's config from OUTBOX, the environment and overrides; None overrides are ignored."""
    raw = raw_settings()
    raw = raw if isinstance(raw, Mapping) else {}
    values = {**DEFAULTS, **raw, **{k: v for k, v in overrides.items() if v is not None}}
    project = project_name()
    per_queue = values["per_queue"] if isinstance(values["per_queue"], Mapping) else {}
    # A queue's limits start from the shared ones the user set; what neither sets defaults (and a
    # keep-alive interval nobody set is derived from the queue's own redelivery timeout).
    explicit = {name: values[name] for name in LIMIT_NAMES if name in raw}
    return QueueConfig(
        base_kafka_config=base_kafka_config(),
        topic=values["topic"] or f"{project}-queue",
        markers_topic=values["markers_topic"] or f"{project}-queue-markers",
        partitions=values["partitions"],
        markers_partitions=values["markers_partitions"],
        consumer_group_prefix=values["consumer_group_prefix"] or f"{project}-queue-",
        tracker_group=values["tracker_group"] or f"{project}-queue-tracker",
        limits=_limits(values),
        per_queue={queue: _limits({**explicit, **limits}) for queue, limits in per_queue.items()
                   if isinstance(limits, Mapping)},
        poll_interval=_seconds(values["poll_interval"]),
    )


def _limits(values: Mapping[str, Any]) -> QueueLimits:
    return QueueLimits(**{name: _seconds(values[name]) for name in LIMIT_NAMES if name in values})


def _seconds(value: Any) -> Any:
    return value.total_seconds() if isinstance(value, timedelta) else value
