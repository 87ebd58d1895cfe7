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

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

from django.conf import settings

from outbox import conf as outbox_conf
from outbox.kafka.keys import read, seconds
from outbox.kafka.problems import Problem, unknown_keys
from outbox.kafka.redaction import scrub
from outbox.queue.config import LIMIT_NAMES, QueueConfig, QueueLimits

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
#: The keys of OUTBOX["queues"]: QueueConfig's (those with a meaning) and a queue's limits.
KEYS = frozenset(spec.name for spec in dataclasses.fields(QueueConfig) if "doc" in spec.metadata)
KNOWN_KEYS = KEYS | frozenset(LIMIT_NAMES)
#: The names that derive from the project's when unset (None or empty).
DERIVED = {"topic": "{}-queue", "markers_topic": "{}-queue-markers", "consumer_group_prefix": "{}-queue-",
           "tracker_group": "{}-queue-tracker"}


def raw_settings() -> Any:
    value = outbox_conf.current().raw.get("queues", {})
    return {} if value is None else value


def project_name() -> str:
    module = os.environ.get("DJANGO_SETTINGS_MODULE") or getattr(settings, "SETTINGS_MODULE", None) or "django"
    return module.split(".")[0]


def setting(name: str) -> Any:
    """One OUTBOX["queues"] value with its default (durations in seconds)."""
    return getattr(queue_config(), name)


def problems() -> list[Problem]:
    """Everything wrong with OUTBOX["queues"], for `manage.py check`."""
    raw = raw_settings()
    if not isinstance(raw, Mapping):
        return [Problem("E001", "OUTBOX['queues']", f"must be a dict, got {type(raw).__name__}")]
    found = unknown_keys(raw, KNOWN_KEYS)
    per_queue = raw.get("per_queue", {})
    if not isinstance(per_queue, Mapping):
        found.append(Problem("E003", "per_queue", f"must be a dict of queue name to limits, got {per_queue!r}"))
    for queue, limits in per_queue.items() if isinstance(per_queue, Mapping) else ():
        found += unknown_keys(limits, LIMIT_NAMES, f"per_queue[{queue!r}].") if isinstance(limits, Mapping) else \
            [Problem("E003", f"per_queue[{queue!r}]", f"must be a dict of limits, got {limits!r}")]
    try:
        config, broken = _read(raw)
    except (TypeError, ValueError) as error:  # a value too malformed to build the config from
        return [*found, Problem("E003", "OUTBOX['queues']", str(error))]
    # The limits and the keys' relations are checked once every key is known and of its kind.
    return found + broken if found else broken + config.validate(_inherited(raw))


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
    given = {name: value for name, value in overrides.items() if value is not None}
    return _read({**(raw if isinstance(raw, Mapping) else {}), **given})[0]


def _read(raw: Mapping[str, Any]) -> tuple[QueueConfig, list[Problem]]:
    """The config from OUTBOX["queues"] (a key in breach of its rule keeps its default), and those breaches. A
    queue's limits start from the shared ones the user set; what neither sets defaults (and a keep-alive interval
    nobody set is derived from the queue's own redelivery timeout)."""
    # A name unset, None, empty or in breach of its rule is the project's.
    config, found = read(QueueConfig, {name: value for name, value in raw.items()
                                       if name in KEYS and (value or name not in DERIVED)})
    kept = {name for name in DERIVED if raw.get(name) and not any(p.field == name for p in found)}
    explicit = {name: raw[name] for name in LIMIT_NAMES if name in raw}
    per_queue = config.per_queue if isinstance(config.per_queue, Mapping) else {}
    return dataclasses.replace(config, base_kafka_config=outbox_conf.kafka_config(), limits=_limits(explicit),
                               per_queue={queue: _limits({**explicit, **limits}) for queue, limits in per_queue.items()
                                          if isinstance(limits, Mapping)},
                               **{name: form.format(project_name()) for name, form in DERIVED.items()
                                  if name not in kept}), found


def _limits(values: Mapping[str, Any]) -> QueueLimits:
    return QueueLimits(**{name: seconds(values[name]) for name in LIMIT_NAMES if name in values})
