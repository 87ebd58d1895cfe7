"""Kafka clients for the harvester: the record producer, and the leader election's consumer and producer.

Factories take the merged librdkafka config, so tests swap in fakes with the same signatures.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from outbox.harvest.config import HarvestConfig
from outbox.kafka.client_errors import log_client_error
from outbox.kafka.clients import (
    KAFKA_START_TIMEOUT,
    LIBRDKAFKA_BATCH_SIZE,
    KafkaUnavailable,
    admin_config,
    check_log,
    client_log,
)
from outbox.kafka.problems import Problem
from outbox.kafka.sizes import UNLIMITED, batch_size_for
from outbox.reasons import kafka_reason

log = logging.getLogger(__name__)
ProducerFactory = Callable[[dict[str, Any]], "ProducerLike"]
ConsumerFactory = Callable[[dict[str, Any]], "ConsumerLike"]
TopicEnsurer = Callable[[dict[str, Any], str, float], None]


class ProducerLike(Protocol):
    def produce(self, topic: str, value: Any = None, key: Any = None, partition: int = ..., on_delivery: Any = None,
                headers: Any = None) -> None: ...
    def poll(self, timeout: float = ...) -> int: ...
    def flush(self, timeout: float = ...) -> int: ...
    def __len__(self) -> int: ...


class ConsumerLike(Protocol):
    def subscribe(self, topics: list[str], on_assign: Any = None, on_revoke: Any = None,
                  on_lost: Any = None) -> None: ...
    def consume(self, num_messages: int = ..., timeout: float = ...) -> list[Any]: ...
    def close(self) -> None: ...


#: librdkafka's own delivery timeout when several records of a key may be in flight: the engine
#: enforces `delivery_timeout` itself (by purging the producer), so librdkafka never times out a
#: queued record on its own, which could let a later record of its key through (a gap).
PIPELINED_LIBRDKAFKA_TIMEOUT_MS = 2_147_483_647
#: librdkafka's largest socket.timeout.ms.
MAX_SOCKET_TIMEOUT_MS = 300_000


def record_producer_config(config: HarvestConfig, batch_limit: int | None = None) -> dict[str, Any]:
    """Config of the producer that publishes outbox records, its batches at most `batch_limit` bytes
    (the smallest max.message.bytes of the topics it sends to, topics.py).

    Idempotence is on: librdkafka's retries never duplicate or reorder a message within the
    producer's session. With one record per key in flight (goharvest's barrier),
    delivery.timeout.ms is the engine's delivery_timeout, which stays below the time Kafka takes
    to hand leadership to another replica (docs/tuning.md, "Fail-over timing", has the arithmetic). With several,
    a key's records must reach the log as a prefix of what was sent, never with a hole: so
    `enable.gapless.guarantee` turns a refused batch into a fatal error (the engine replaces the
    producer and re-marks), and the timeout is enforced by the engine purging the whole producer
    rather than by librdkafka dropping single queued records.
    """
    limits = config.limits
    pipelined = limits.max_in_flight_per_key > 1
    merged: dict[str, Any] = {
        "enable.idempotence": True,
        # A key's next record may wait for the last one's ack: lingering would delay every key by
        # the linger time. librdkafka still batches under load (records queue while earlier requests
        # are in flight). Measured in docs/benchmarks.md.
        "linger.ms": 0,
        "delivery.timeout.ms": (PIPELINED_LIBRDKAFKA_TIMEOUT_MS if pipelined
                                else int(limits.delivery_timeout * 1000)),
        "client.id": f"{config.name}-records",
    }
    if pipelined:
        merged["enable.gapless.guarantee"] = True
    merged.update(config.base_kafka_config)
    merged.update(config.producer_kafka_config)
    if batch_limit is not None and batch_limit < UNLIMITED:
        merged["batch.size"] = min(_int(merged.get("batch.size"), LIBRDKAFKA_BATCH_SIZE), batch_size_for(batch_limit))
    merged.setdefault("error_cb", log_client_error)
    merged.setdefault("logger", client_log)
    return merged


def _int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def dead_letter_producer_config(config: HarvestConfig) -> dict[str, Any]:
    """The producer of the dead-letter topic: the record producer's settings, one record at a time."""
    merged = record_producer_config(config)
    merged.pop("enable.gapless.guarantee", None)
    merged["delivery.timeout.ms"] = int(config.limits.delivery_timeout * 1000)
    merged["client.id"] = f"{config.name}-dead-letters"
    return merged


def election_socket_timeout_ms(config: HarvestConfig) -> int:
    """How long the leader election's clients wait on one request to a broker (librdkafka's default is 60 s).

    A broker that hangs rather than dies (a paused VM, a network black hole) keeps its sockets open:
    a request to it is only abandoned after this long, and only then does the client look up the
    partition's new leader or the group's new coordinator. At librdkafka's 60 s a fenced leader
    (and any successor) saw no heartbeat for a minute after Kafka had already moved the partition
    (measured: docs/kafka.md); at two heartbeat timeouts it resumes within
    about three.
    """
    # librdkafka takes at most 300 s: a heartbeat_timeout over 150 s would otherwise be refused as a
    # socket.timeout.ms nobody set.
    return min(MAX_SOCKET_TIMEOUT_MS, max(1000, int(2 * config.limits.heartbeat_timeout * 1000)))


def heartbeat_producer_config(config: HarvestConfig) -> dict[str, Any]:
    """The leader's heartbeat producer: unbatched, and a delivery deadline of one heartbeat timeout (as goneli)."""
    merged: dict[str, Any] = dict(config.base_kafka_config)
    merged.setdefault("socket.timeout.ms", election_socket_timeout_ms(config))
    merged.update({
        "linger.ms": 0,
        "delivery.timeout.ms": int(config.limits.heartbeat_timeout * 1000),
        "client.id": f"{config.name}-heartbeat",
        "error_cb": log_client_error,
        "logger": client_log,
    })
    return merged


def leader_consumer_config(config: HarvestConfig) -> dict[str, Any]:
    """The leader-election consumer: Kafka's group coordinator picks one owner for partition 0.

    The session timeout is three heartbeat timeouts (as goneli): a leader that stops seeing
    its own heartbeats fences itself well before Kafka could give partition 0 to another replica.
    """
    merged: dict[str, Any] = dict(config.base_kafka_config)
    merged.setdefault("socket.timeout.ms", election_socket_timeout_ms(config))
    merged.update({
        "group.id": config.leader_group,
        "client.id": f"{config.name}-leader",
        "enable.auto.commit": False,
        "auto.offset.reset": "latest",
        "session.timeout.ms": int(3 * config.limits.heartbeat_timeout * 1000),
        "heartbeat.interval.ms": max(100, int(config.limits.heartbeat_timeout * 1000 / 5)),
        "enable.partition.eof": False,
        # Cooperative rebalancing moves only the partitions that change owner: a standby joining or
        # leaving does not revoke partition 0 from the leader (eager rebalancing would, every time).
        "partition.assignment.strategy": "cooperative-sticky",
        "error_cb": log_client_error,
        "logger": client_log,
    })
    # librdkafka refuses a session timeout above max.poll.interval.ms (5 minutes by default), which a
    # heartbeat_timeout over 100 s makes.
    merged["max.poll.interval.ms"] = max(_int(merged.get("max.poll.interval.ms"), 300_000),
                                         merged["session.timeout.ms"])
    return merged


def client_config_problems(config: HarvestConfig) -> list[Problem]:
    """librdkafka's own verdict on the settings (unknown property, bad value, a file it cannot read), found by
    building the clients without letting them connect: one E013, naming the setting that holds the property. The
    leader consumer is built from `base_kafka_config` alone, so what it refuses is that setting's (said once, not
    again by each client); what only the record producer refuses is `producer_kafka_config`'s, unless the producer
    without it is refused too (a base property only producers read). A refusal where a `*.location` of that setting
    names no file says so, with the path (librdkafka's own words are "BIO lib")."""
    field = "base_kafka_config"
    refused = _refused(Consumer, leader_consumer_config(config))
    if refused is None:
        refused = _refused(Producer, record_producer_config(config))
        if refused is not None and config.producer_kafka_config and _refused(
                Producer, record_producer_config(dataclasses.replace(config, producer_kafka_config={}))) is None:
            field = "producer_kafka_config"
    if refused is None:
        return []
    missing = _missing_file(field, getattr(config, field), refused)
    return [missing or Problem("E013", field, f"is refused by librdkafka: {refused}")]


def _refused(build: Callable[[dict[str, Any]], Any], settings: dict[str, Any]) -> str | None:
    """Why librdkafka refuses to build a client of `settings` (it never connects), or None."""
    try:
        client = build({**settings, "logger": check_log, "error_cb": lambda _error: None,
                        "bootstrap.servers": "127.0.0.1:1"})
    except (KafkaException, ValueError, TypeError) as error:
        return kafka_reason(error)
    if isinstance(client, Consumer):
        client.close()
    else:
        client.flush(0)
    return None


def _missing_file(field: str, settings: Mapping[str, Any], refused: str) -> Problem | None:
    """The `*.location` property (a CA, certificate, key or keystore file) librdkafka's refusal names, where it names
    no file or directory (one that TLS does not use, with a plaintext protocol, librdkafka accepts)."""
    for key, value in settings.items():
        if (key.endswith(".location") and key in refused and isinstance(value, str) and value != "probe"
                and not os.path.exists(value)):
            return Problem("E013", field, f"{key!r} names {value!r}, which does not exist")
    return None


#: Errors no retry can fix: the client's credentials or its trust in the brokers' certificates are wrong.
CONFIGURATION_ERRORS = frozenset({KafkaError._AUTHENTICATION, KafkaError.SASL_AUTHENTICATION_FAILED, KafkaError._SSL})
_BROKER_PREFIX = re.compile(r"^(?:\w+://)?[^\s/]+/\w+: ")  # "sasl_ssl://127.0.0.1:9194/bootstrap: ", "b1:9092/2: "
_STATE_SUFFIX = re.compile(r" \(after \d+ms in state \w+[^)]*\)$")  # " (after 308ms in state AUTH_REQ)"


class ConnectionProblems:
    """What a client met while first connecting (its error callbacks), to say in one line why it could not.

    Also a logger for the client: librdkafka's own lines about those attempts go to DEBUG, as the
    one-line reason says it all.
    """

    def __init__(self) -> None:
        self.errors: list[KafkaError] = []

    def error_cb(self, error: KafkaError) -> None:
        self.errors.append(error)

    def log(self, level: int, msg: str, *args: Any) -> None:
        client_log.debug(msg, *args)

    @property
    def hopeless(self) -> KafkaError | None:
        """The first authentication or TLS error, if any: retrying will not help."""
        return next((e for e in self.errors if e.code() in CONFIGURATION_ERRORS), None)

    def describe(self, bootstrap: str, fallback: str) -> str:
        """One line: why Kafka at `bootstrap` could not be used (`fallback`: the failed call's own error)."""
        hopeless = self.hopeless
        if hopeless is not None and hopeless.code() == KafkaError._SSL:
            return f"TLS with Kafka at {bootstrap} failed: {_clean(hopeless.str())}"
        if hopeless is not None:
            return f"Kafka at {bootstrap} refused the login: {_clean(hopeless.str())}"
        transport = next((e for e in reversed(self.errors) if e.code() == KafkaError._TRANSPORT), None)
        return f"Kafka is unreachable at {bootstrap}: {_clean(transport.str()) if transport else fallback}"


def _clean(text: str) -> str:
    return _STATE_SUFFIX.sub("", _BROKER_PREFIX.sub("", text.strip()))


#: How many times `timeout` a start waits for a broker that is connected but slow to answer (a metadata
#: request timed out, rather than no broker being up): a loaded broker is not an unreachable one.
SLOW_BROKER_PATIENCE = 6


def cluster_metadata(base: Mapping[str, Any], timeout: float, topic: str | None = None) -> Any:
    """Kafka's metadata, or KafkaUnavailable saying why not: unreachable, a refused login, an untrusted certificate.

    Asks once a second and gives up at once on an error no retry can fix. No broker up after `timeout` is
    unreachable; a broker that is up but has not answered (every request timed out) gets SLOW_BROKER_PATIENCE
    times as long, saying once that it waits. With `topic`, asks again every 0.1 s until the metadata shows
    that topic's partitions (one another replica has just made can show without them for a moment), and
    returns the last metadata it got when the time is up.
    """
    problems = ConnectionProblems()
    admin = AdminClient({**admin_config(base), "error_cb": problems.error_cb, "logger": problems})
    bootstrap = base.get("bootstrap.servers", "?")
    started = time.monotonic()
    deadline = started + timeout
    while True:
        try:
            metadata = admin.list_topics(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
        except KafkaException as error:
            admin.poll(0)  # serves the error callbacks
            if problems.hopeless is not None:
                raise KafkaUnavailable(problems.describe(bootstrap, kafka_reason(error))) from None
            if time.monotonic() < deadline:
                continue
            slow = error.args and error.args[0].code() == KafkaError._TIMED_OUT
            if slow and deadline == started + timeout:
                deadline = started + timeout * SLOW_BROKER_PATIENCE
                log.warning("Kafka at %s is up but has not answered for %gs: waiting up to %gs", bootstrap,
                            timeout, timeout * SLOW_BROKER_PATIENCE)
                continue
            raise KafkaUnavailable(problems.describe(bootstrap, kafka_reason(error))) from None
        if topic is None or partitions_shown(metadata, topic) or time.monotonic() >= deadline:
            return metadata
        time.sleep(0.1)


def partitions_shown(metadata: Any, topic: str) -> int:
    """How many partitions the metadata shows `topic` with (0: none yet, or not there)."""
    found = metadata.topics.get(topic)
    return len(found.partitions) if found is not None and found.error is None else 0


def ensure_topic(base: dict[str, Any], topic: str, timeout: float, partitions: int = 1) -> int:
    """Create the leader topic with `partitions` partitions (one per shard) unless it exists; returns
    how many partitions it has. Raises KafkaUnavailable if Kafka cannot be used."""
    found = partitions_shown(cluster_metadata(base, timeout), topic)
    if found:
        return found
    admin = AdminClient(admin_config(base))
    bootstrap = base.get("bootstrap.servers", "?")
    futures = admin.create_topics([NewTopic(topic, num_partitions=partitions)], request_timeout=timeout)
    try:
        futures[topic].result(timeout=timeout)
        log.info("Created leader topic %s (%d partition%s)", topic, partitions, "s" if partitions > 1 else "")
    except KafkaException as error:
        if error.args and error.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:  # another replica made it
            # The number it has, not the number asked for, once the metadata shows it.
            found = partitions_shown(cluster_metadata(base, timeout, topic=topic), topic)
            if not found:
                raise KafkaUnavailable(f"leader topic {topic!r} exists at {bootstrap} but its partitions were not "
                                       f"known within {timeout:g}s") from None
            return found
        raise KafkaUnavailable(f"cannot create leader topic {topic!r} at {bootstrap}: {kafka_reason(error)}") from None
    return partitions


def ensure_leader_topic(config: HarvestConfig) -> None:
    """`config`'s leader topic, made with a partition per shard unless it exists, and checked to have that many."""
    found = ensure_topic(dict(config.base_kafka_config), config.leader_topic, KAFKA_START_TIMEOUT, config.shards)
    check_leader_partitions(config.leader_topic, found, config.shards)


def check_leader_partitions(topic: str, found: int, shards: int) -> None:
    """A replica runs as many shards as its group's leader topic has partitions, or does not start."""
    if found != shards:
        raise KafkaUnavailable(
            f"leader topic {topic!r} has {found} partition(s), one per shard of its group, but this replica runs "
            f"{shards} shard(s): every replica of a group runs the same number (to change it, stop the group and "
            f"run manage.py outbox_reshard --shards {shards}, or outbox-harvest reshard --shards {shards})")
