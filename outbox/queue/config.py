"""The queue's configuration: one frozen object for the topic pair, the trackers and every logical queue.

Durations are seconds. Per-queue limits (redelivery timeout, keep-alive interval, max in
progress, max deliveries) default to the shared ones and may be overridden per queue name.
Nothing here imports Django.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from outbox.kafka.keys import (
    is_int,
    is_number,
    key,
    positive_seconds,
    positive_seconds_or_none,
    rule,
    rule_problems,
    seconds_or_zero,
)
from outbox.kafka.names import MAX_TOPIC_LENGTH, TOPIC_NAME, is_topic_name
from outbox.kafka.problems import Problem
from outbox.kafka.redaction import redact_mapping

#: Logical queue names: Kafka's topic-name characters, so a name never contains the "/" that
#: separates it from a message id in the keys of stashed messages.
QUEUE_NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,200}")
#: Longest redelivery timeout: kafka-mq-go's limit (12 hours).
MAX_REDELIVERY_TIMEOUT = 12 * 3600.0
#: How a queue is carried: "markers" (our markers topic and redelivery trackers, any Kafka) or "share"
#: (Kafka's own share groups, KIP-932: Apache Kafka 4.2 and later).
BACKENDS = ("markers", "share")
#: The share backend's redelivery timeout is the group's record lock duration: Kafka takes 1 s to 1 hour
#: (within the broker's group.share.min/max.record.lock.duration.ms).
SHARE_LOCK_RANGE = (1.0, 3600.0)
#: The broker archives a record after group.share.delivery.count.limit deliveries (at most 10): a share
#: queue's max_deliveries stays below it, so its dead letter is written first.
SHARE_MAX_DELIVERIES = 9


@dataclass(frozen=True)
class QueueLimits:
    """What a consumer of one logical queue promises the trackers, and how much it takes at once."""

    redelivery_timeout: float = key(30.0, "seconds without a marker before a message is redelivered (0.1 to 43,200)")
    keep_alive_interval: float | None = key(None, "keep-alive markers are sent this often while a message is in hand; "
                                                  "must be below the timeout; above half of it is warning "
                                                  "`outbox_queue.W001` (the markers backend: the share backend sends "
                                                  "none)", shown="`redelivery_timeout / 3`")
    max_in_progress: int = key(10, "messages a consumer holds at once (back-pressure; also its Start transaction's "
                                   "largest batch)")
    max_deliveries: int | None = key(5, "deliveries before a message becomes a dead letter; `None`: no limit")
    backend: str = key("markers", "`\"markers\"` (this page) or `\"share\"` (Kafka's share groups, 4.2+): "
                                  "[queue-backends.md](../queue-backends.md)")

    def __post_init__(self) -> None:
        if self.keep_alive_interval is None and is_number(self.redelivery_timeout):
            object.__setattr__(self, "keep_alive_interval", self.redelivery_timeout / 3)

    def problems(self, prefix: str = "") -> list[Problem]:
        """Every limit in breach, each on its key (after `prefix`); the table's rows are (breach, code, key, why),
        the share backend's own last (what Kafka's share groups cannot do: a lock outside the broker's range,
        unlimited deliveries); it sends no keep-alives."""
        timeout, interval, deliveries, share = (self.redelivery_timeout, self.keep_alive_interval, self.max_deliveries,
                                                self.backend == "share")
        timed, (low, high) = is_number(timeout), SHARE_LOCK_RANGE
        ahead = is_number(interval) and (interval <= 0 or (timed and interval >= timeout))
        rules = [
            (not timed, "E003", "redelivery_timeout", f"must be a number of seconds, got {timeout!r}"),
            (timed and not 0.1 <= timeout <= MAX_REDELIVERY_TIMEOUT, "E004", "redelivery_timeout",
             f"must be between 0.1 and {MAX_REDELIVERY_TIMEOUT:g} seconds, got {timeout!r}"),
            # None: derived from a redelivery_timeout that is not a number, said above
            (interval is not None and not is_number(interval), "E003", "keep_alive_interval",
             f"must be a number of seconds, got {interval!r}"),
            (not share and ahead, "E004", "keep_alive_interval",
             f"must be above 0 and below redelivery_timeout ({f'{timeout:g}s' if timed else repr(timeout)}), got "
             f"{interval!r}: a keep-alive must arrive before the deadline it extends"),
            (not is_int(self.max_in_progress) or self.max_in_progress < 1, "E004", "max_in_progress",
             f"must be a positive integer, got {self.max_in_progress!r}"),
            (deliveries is not None and (not is_int(deliveries) or deliveries < 1), "E004", "max_deliveries",
             f"must be a positive integer or None, got {deliveries!r}"),
            (self.backend not in BACKENDS, "E007", "backend",
             f"must be one of {', '.join(map(repr, BACKENDS))}, got {_show(self.backend)}"),
            (share and timed and not low <= timeout <= high, "E007", "redelivery_timeout",
             f"must be from {low:g} to {high:g} seconds with backend 'share' (the share group's record lock "
             f"duration), got {timeout!r}"),
            (share and (deliveries is None or (is_int(deliveries) and deliveries > SHARE_MAX_DELIVERIES)), "E007",
             "max_deliveries", f"must be from 1 to {SHARE_MAX_DELIVERIES} with backend 'share' (the broker archives a "
                               f"record after at most 10 deliveries), got {deliveries!r}"),
        ]
        return [Problem(code, f"{prefix}{name}", why) for broken, code, name, why in rules if broken]

    def warnings(self, prefix: str = "") -> list[Problem]:
        timeout, interval = self.redelivery_timeout, self.keep_alive_interval
        if self.backend != "share" and is_number(timeout) and is_number(interval) and timeout / 2 < interval < timeout:
            return [Problem("W001", f"{prefix}keep_alive_interval",
                            f"{interval:g}s leaves less than half the redelivery timeout ({timeout:g}s) for a "
                            f"keep-alive to reach the tracker; one slow marker means a needless redelivery")]
        return []


LIMIT_NAMES = tuple(f.name for f in dataclasses.fields(QueueLimits))


def _partitions(value: Any) -> bool:
    return is_int(value) and 1 <= value <= 10_000


_TOPIC, _PARTITIONS = rule(is_topic_name, TOPIC_NAME), rule(_partitions, "must be an integer from 1 to 10000")


@dataclass(frozen=True)
class QueueConfig:
    """The topic pair shared by every logical queue, the trackers' group, the limits per queue, and how the queues'
    processes report: OUTBOX["queues"]'s keys, each with its default, its line in the settings reference and its
    rule (in a Django project the topics' and groups' defaults derive from its name: app_settings.queue_config)."""

    #: librdkafka settings shared by every client: OUTBOX's base_kafka_config (not a key of OUTBOX["queues"]).
    base_kafka_config: Mapping[str, Any] = field(
        default_factory=lambda: {"bootstrap.servers": "localhost:9092"},
        metadata={"code": "E003", "rule": rule(lambda v: isinstance(v, Mapping) and bool(v.get("bootstrap.servers")),
                                               "must be a mapping that sets bootstrap.servers", got=False)})
    topic: str = key("outbox-queue", "the queue topic, shared by every logical queue", _TOPIC, code="E005",
                     shown='`"<project>-queue"`')
    markers_topic: str = key("outbox-queue-markers", "the markers topic", _TOPIC, code="E005",
                             shown='`"<project>-queue-markers"`')
    partitions: int = key(8, "partition counts when the topics are created", _PARTITIONS, code="E004")
    markers_partitions: int = key(4, "partition counts when the topics are created", _PARTITIONS, code="E004")
    consumer_group_prefix: str = key("outbox-queue-", "consumers of queue Q share group `<prefix>Q`",
                                     rule(lambda v: isinstance(v, str), "must be a non-empty string"),
                                     shown='`"<project>-queue-"`')
    tracker_group: str = key("outbox-queue-tracker", "the trackers' consumer group",
                             rule(lambda v: isinstance(v, str) and bool(v.strip()), "must be a non-empty string"),
                             shown='`"<project>-queue-tracker"`')
    #: Limits of every queue not named in per_queue.
    limits: QueueLimits = field(default_factory=QueueLimits)
    per_queue: Mapping[str, QueueLimits] = key({}, "`{\"reports\": {\"redelivery_timeout\": 600, "
                                                   "\"max_in_progress\": 1}}`: the four limits and the backend "
                                                   "below, per queue")
    poll_interval: float = key(0.1, "longest wait of a consumer's or tracker's loop",
                               rule(lambda v: is_number(v) and 0.001 <= v <= 5, "must be from 0.001 to 5 seconds"),
                               code="E004")
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

    def limits_for(self, queue: str) -> QueueLimits:
        return self.per_queue.get(queue, self.limits)

    def consumer_group(self, queue: str) -> str:
        return f"{self.consumer_group_prefix}{queue}"

    def backend(self, queue: str) -> str:
        return self.limits_for(queue).backend

    def share_topic(self, queue: str) -> str:
        """A share queue's own topic: its share group reads no other queue's records."""
        return f"{self.topic}-share-{queue}"

    def share_group(self, queue: str) -> str:
        """A share queue's share group (not its markers consumer group's id: Kafka keeps one kind per id)."""
        return f"{self.consumer_group_prefix}{queue}-share"

    def topic_for(self, queue: str) -> str:
        """Where send() and stash() put a message of `queue`."""
        return self.share_topic(queue) if self.backend(queue) == "share" else self.topic

    def validate(self, inherited: Mapping[str, Collection[str]] | None = None) -> list[Problem]:
        """Every problem at once; an empty list means the config is usable. `inherited`: per queue of per_queue,
        the limits it takes from those set for every queue (OUTBOX["queues"]'s own keys): a problem one of them
        makes in that queue is said on the key the user wrote, naming the queue."""
        found = rule_problems(self)
        if self.topic == self.markers_topic:
            found.append(Problem("E005", "markers_topic", "must differ from topic"))
        found.extend(self.limits.problems())
        for queue, limits in self.per_queue.items():
            if not isinstance(queue, str) or not QUEUE_NAME_PATTERN.fullmatch(queue):
                found.append(Problem("E006", f"per_queue[{queue!r}]", queue_name_problem(queue)))
            _said_where_written(found, limits.problems(prefix=f"per_queue[{queue!r}]."), queue,
                                (inherited or {}).get(queue, ()))
            if isinstance(queue, str) and limits.backend == "share" and isinstance(self.topic, str) \
                    and len(self.share_topic(queue)) > MAX_TOPIC_LENGTH:
                found.append(Problem("E007", f"per_queue[{queue!r}].backend",
                                     f"the share topic {self.share_topic(queue)[:40]!r}... would be longer than "
                                     f"{MAX_TOPIC_LENGTH} characters: shorten the queue name or topic"))
        return found

    def warnings(self, inherited: Mapping[str, Collection[str]] | None = None) -> list[Problem]:
        """Settings that work but risk needless redeliveries (`inherited` as for validate())."""
        found = self.limits.warnings()
        for queue, limits in self.per_queue.items():
            _said_where_written(found, limits.warnings(prefix=f"per_queue[{queue!r}]."), queue,
                                (inherited or {}).get(queue, ()))
        return found

    def redacted(self) -> dict[str, Any]:
        """The configuration as plain data, with secrets masked."""
        return {**{spec.name: getattr(self, spec.name) for spec in dataclasses.fields(self)},
                "base_kafka_config": redact_mapping(self.base_kafka_config), "limits": dataclasses.asdict(self.limits),
                "per_queue": {queue: dataclasses.asdict(limits) for queue, limits in self.per_queue.items()}}

    def __repr__(self) -> str:  # never let a SASL password reach a log line through repr()
        return f"QueueConfig({self.redacted()!r})"


def _said_where_written(found: list[Problem], problems: list[Problem], queue: str, taken: Collection[str]) -> None:
    """Add a queue's `problems` to `found`, each on the key the user wrote: one of the limits the queue `taken` from
    those set for every queue is said on that shared key, naming the queue (and once only, when it is the same
    problem as for every queue)."""
    for problem in problems:
        key = problem.field.rsplit(".", 1)[1]
        if key in taken:
            if Problem(problem.code, key, problem.message) in found:
                continue
            problem = Problem(problem.code, key, f"{problem.message} (in queue {queue!r}, which takes it from here)")
        if problem not in found:
            found.append(problem)


def queue_name_problem(queue: object) -> str:
    return f"must be 1-200 characters of a-z A-Z 0-9 . _ - (a queue name), got {_show(queue)}"


def check_queue_name(queue: object) -> str:
    """The name itself, or ValueError naming the rule."""
    if not isinstance(queue, str) or not QUEUE_NAME_PATTERN.fullmatch(queue):
        raise ValueError(f"queue: {queue_name_problem(queue)}")
    return queue


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
