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
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from outbox import conf as outbox_conf
from outbox.kafka.keys import key, positive_seconds, positive_seconds_or_none, read, seconds, seconds_or_zero
from outbox.kafka.problems import Problem, unknown_keys
from outbox.kafka.redaction import scrub
from outbox.queue.config import LIMIT_NAMES, QueueConfig, QueueLimits


@dataclass(frozen=True)
class QueueKeys:
    """The keys of OUTBOX["queues"] that are not a queue's limits (those are QueueLimits'), each with its default,
    its line in the settings reference and its rule; the topics' and groups' names derive from the project's when
    unset, and QueueConfig.validate checks what needs the whole config."""

    topic: str | None = key(None, "the queue topic, shared by every logical queue", shown='`"<project>-queue"`')
    markers_topic: str | None = key(None, "the markers topic", shown='`"<project>-queue-markers"`')
    partitions: int = key(8, "partition counts when the topics are created")
    markers_partitions: int = key(4, "partition counts when the topics are created")
    consumer_group_prefix: str | None = key(None, "consumers of queue Q share group `<prefix>Q`",
                                            shown='`"<project>-queue-"`')
    tracker_group: str | None = key(None, "the trackers' consumer group", shown='`"<project>-queue-tracker"`')
    per_queue: Mapping[str, Any] = key({}, "`{\"reports\": {\"redelivery_timeout\": 600, \"max_in_progress\": 1}}`: "
                                           "the four limits and the backend below, per queue")
    poll_interval: float = key(0.1, "longest wait of a consumer's or tracker's loop")
    status_interval: float = key(2.0, "status rows (admin) are written this often", positive_seconds, code="E004")
    status_gone_after: float = key(20.0, "admin calls a process not seen for this long gone", positive_seconds,
                                   code="E004")
    inbox_retention: float = key(7 * 24 * 3600.0, "inbox rows (`outbox_consume --inbox`) older than this (seconds) "
                                                  "are pruned", positive_seconds, code="E004")
    history_interval: float = key(10.0, "a tracker adds a sample per queue (in progress, redeliveries, dead letters) "
                                        "to `outbox_queue_history`, the admin's charts, this often, with its status "
                                        "row (0: never)", seconds_or_zero, code="E004")
    history_retention: float = key(24 * 3600.0, "samples older than this (seconds) are deleted", positive_seconds,
                                   code="E004")
    dead_letter_retention: float | None = key(30 * 24 * 3600.0, "dead letters written longer ago than this (30 days) "
                                                                "are deleted by the trackers, once a minute; `None` "
                                                                "keeps them until an operator acts",
                                              positive_seconds_or_none, code="E004")


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
KNOWN_KEYS = frozenset(QueueKeys.__dataclass_fields__) | frozenset(LIMIT_NAMES)


def raw_settings() -> Any:
    value = outbox_conf.current().raw.get("queues", {})
    return {} if value is None else value


def _keys() -> tuple[QueueKeys, list[Problem]]:
    raw = raw_settings()
    return read(QueueKeys, raw if isinstance(raw, Mapping) else {})


def project_name() -> str:
    module = os.environ.get("DJANGO_SETTINGS_MODULE") or getattr(settings, "SETTINGS_MODULE", None) or "django"
    return module.split(".")[0]


def setting(name: str) -> Any:
    """One OUTBOX["queues"] value with its default (durations in seconds)."""
    return getattr(_keys()[0], name)


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
    found.extend(_keys()[1])
    if found:
        return found
    try:
        config = queue_config()
    except (TypeError, ValueError) as error:  # a value too malformed to build the config from
        return [Problem("E003", "OUTBOX['queues']", str(error))]
    return config.validate(_inherited(raw))


def describe(problem: Problem) -> str:
    """One line naming the setting as the user wrote it, as the outbox's checks do (`check` and the queue commands
    alike): OUTBOX['queues']['per_queue']['alpha']['backend'] must be one of ... (secret values masked)."""
    if problem.field.startswith("OUTBOX"):
        return scrub(f"{problem.field} {problem.message}", outbox_conf.secret_values())
    # A queue's own key is named per_queue['<queue, as repr() writes it>'].<key>; any other field is one key of the
    # user's mapping, written as repr() writes it (a newline in it must not make two lines).
    queue = re.fullmatch(r"per_queue(\[.*\])(?:\.(\w+))?", problem.field, re.S)
    if queue is None:
        path = f"[{problem.field!r}]"
    else:
        path = f"['per_queue']{queue.group(1)}" + (f"[{queue.group(2)!r}]" if queue.group(2) else "")
    return scrub(f"OUTBOX['queues']{path} {problem.message}", outbox_conf.secret_values())


def warnings() -> list[Problem]:
    if problems():
        return []
    return queue_config().warnings(_inherited(raw_settings()))


def _inherited(raw: Mapping[str, Any]) -> dict[str, set[str]]:
    """Per queue of per_queue, the limits it takes from those OUTBOX["queues"] sets for every queue."""
    shared = {name for name in LIMIT_NAMES if name in raw}
    return {queue: shared - set(limits) for queue, limits in raw.get("per_queue", {}).items()}


def queue_config(**overrides: Any) -> QueueConfig:
    """The queue's config from OUTBOX, the environment and overrides; None overrides are ignored."""
    raw = raw_settings()
    raw = {**(raw if isinstance(raw, Mapping) else {}), **{k: v for k, v in overrides.items() if v is not None}}
    keys = read(QueueKeys, raw)[0]
    per_queue = keys.per_queue if isinstance(keys.per_queue, Mapping) else {}
    project = project_name()
    # A queue's limits start from the shared ones the user set; what neither sets defaults (and a
    # keep-alive interval nobody set is derived from the queue's own redelivery timeout).
    explicit = {name: raw[name] for name in LIMIT_NAMES if name in raw}
    return QueueConfig(
        base_kafka_config=outbox_conf.kafka_config(),
        topic=keys.topic or f"{project}-queue",
        markers_topic=keys.markers_topic or f"{project}-queue-markers",
        partitions=keys.partitions,
        markers_partitions=keys.markers_partitions,
        consumer_group_prefix=keys.consumer_group_prefix or f"{project}-queue-",
        tracker_group=keys.tracker_group or f"{project}-queue-tracker",
        limits=_limits(explicit),
        per_queue={queue: _limits({**explicit, **limits}) for queue, limits in per_queue.items()
                   if isinstance(limits, Mapping)},
        poll_interval=keys.poll_interval,
    )


def _limits(values: Mapping[str, Any]) -> QueueLimits:
    return QueueLimits(**{name: seconds(values[name]) for name in LIMIT_NAMES if name in values})
