"""A setting declared once: a frozen dataclass field holding its default, what it does (the settings reference's
line), and the rule its value must meet. OUTBOX's own keys (conf.OutboxKeys), the harvester's limits
(harvest.config.Limits), the queues' keys (queue.config.QueueConfig) are such dataclasses, read from the user's
mapping by `read()`, which reports each problem once, on the key the user wrote.

Also the one fallback of `bootstrap.servers` every reader of settings shares (OUTBOX, OUTBOX["queues"], the stand-alone
harvester's file): the settings' own, else KAFKA_BOOTSTRAP_SERVERS, else localhost:9092, with a warning (W006)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

from outbox.kafka.problems import Problem

#: Where Kafka is looked for when nothing names it: librdkafka's own default, said by `check` as W006.
DEFAULT_BOOTSTRAP_SERVERS = "localhost:9092"
#: A rule: why a value breaks it (completing "OUTBOX['key'] ..."), or None.
Rule = Callable[[Any], str | None]
Section = TypeVar("Section")


def key(default: Any, meaning: str, rule: Rule | None = None, *, code: str = "E003", shown: str | None = None) -> Any:
    """A field of a settings dataclass: its default, its meaning, its rule and the check code of a breach, and the
    default as the reference shows it when not as written (a formula, a derived name)."""
    factory = (lambda: type(default)(default)) if isinstance(default, dict | list) else None
    metadata = {"doc": meaning, "rule": rule, "code": code, "shown": shown}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def shown_default(spec: dataclasses.Field[Any]) -> str:
    """A field's default as the settings reference shows it."""
    if spec.metadata.get("shown"):
        return str(spec.metadata["shown"])
    default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
    return f"`{default!r}`".replace("'", '"')


def seconds(value: Any) -> Any:
    """Durations are seconds; a timedelta works too."""
    return value.total_seconds() if isinstance(value, timedelta) else value


def read(section: type[Section], raw: Mapping[str, Any]) -> tuple[Section, list[Problem]]:
    """The section's keys from `raw` (the user's mapping; keys it does not declare are ignored), and what breaks
    their rules. A key in breach keeps its default in the section, so what reads it meanwhile works."""
    values, found = {}, []
    for spec in dataclasses.fields(section):  # type: ignore[arg-type]
        if spec.name not in raw:
            continue
        value, rule = seconds(raw[spec.name]), spec.metadata.get("rule")
        problem = rule(value) if rule is not None else None
        if problem is None:
            values[spec.name] = value
        else:
            found.append(Problem(spec.metadata["code"], spec.name, problem))
    return section(**values), found


def rule(ok: Callable[[Any], bool], message: str, got: bool = True) -> Rule:
    """A rule from a predicate: `message` when the value is not `ok`, followed by ", got <value>" (unless `got` is
    False, for a message that must not quote a value)."""
    return lambda value: None if ok(value) else f"{message}, got {value!r}" if got else message


def rule_problems(instance: Any) -> list[Problem]:
    """Each field of a built settings dataclass that breaks its rule (what a config built by hand is checked by)."""
    found = []
    for spec in dataclasses.fields(instance):
        rule = spec.metadata.get("rule")
        if rule is not None and (problem := rule(getattr(instance, spec.name))) is not None:
            found.append(Problem(spec.metadata["code"], spec.name, problem))
    return found


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value  # NaN fails


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(value: Any) -> str | None:
    return None if is_int(value) and value >= 1 else f"must be a positive integer, got {value!r}"


def positive_seconds(value: Any) -> str | None:
    return None if is_number(value) and value > 0 else f"must be a positive number of seconds, got {value!r}"


def positive_seconds_or_none(value: Any) -> str | None:
    ok = value is None or (is_number(value) and value > 0)
    return None if ok else f"must be a positive number of seconds or None, got {value!r}"


def seconds_or_zero(value: Any) -> str | None:
    return None if is_number(value) and value >= 0 else f"must be a number of seconds, 0 or more, got {value!r}"


def boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"must be True or False, got {value!r}"


def bootstrap(base: Mapping[str, Any], environ: Mapping[str, str], given_by: str) -> tuple[dict[str, Any], str | None]:
    """librdkafka settings with bootstrap.servers: `base`'s own, else KAFKA_BOOTSTRAP_SERVERS, else localhost:9092;
    and where they came from (`given_by`, "KAFKA_BOOTSTRAP_SERVERS", or None when nothing named Kafka)."""
    merged = dict(base)
    if merged.get("bootstrap.servers"):
        return merged, given_by
    if environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        merged["bootstrap.servers"] = environ["KAFKA_BOOTSTRAP_SERVERS"]
        return merged, "KAFKA_BOOTSTRAP_SERVERS"
    merged["bootstrap.servers"] = DEFAULT_BOOTSTRAP_SERVERS
    return merged, None


#: W006: nothing names Kafka, so every client tries localhost:9092.
NO_BOOTSTRAP = Problem("W006", "base_kafka_config", f"sets no bootstrap.servers and KAFKA_BOOTSTRAP_SERVERS is not "
                                                    f"set either, so Kafka is looked for at "
                                                    f"{DEFAULT_BOOTSTRAP_SERVERS}: set one of them")
