"""Kafka as the audit reads it: a quick reachability check, fixed offsets, Spark's Kafka source.

The check uses confluent-kafka's AdminClient so that an unreachable broker or a missing topic is a
one-line error before Spark starts. A batch audit pins each partition's offsets (low and high
watermarks) at start and hands them to Spark, so every Spark job of the run reads the same
messages however many arrive meanwhile.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

if TYPE_CHECKING:  # the pre-flight checks run before (and without) pyspark
    from pyspark.sql import DataFrame, SparkSession

from outbox.harvest.kafka import ConnectionProblems
from outbox.kafka.clients import silent_logger
from outbox.reasons import kafka_reason

KAFKA_PREFIX = "kafka."
# Larger fetches than the Java client's defaults (1 MiB a partition): ~15% faster scans of small messages.
FETCH_DEFAULTS = {"kafka.max.partition.fetch.bytes": str(16 << 20), "kafka.fetch.max.bytes": str(64 << 20),
                  "kafka.receive.buffer.bytes": str(4 << 20)}
# librdkafka's own log lines (connection refused...) go nowhere: errors come back as one line.
_quiet = silent_logger("outbox.pipeline.librdkafka")


class SourceError(Exception):
    """A one-line reason why Kafka cannot be read (unreachable, unknown topic...)."""


#: Java client options that librdkafka refuses outright (rather than ignoring as unknown).
_JAVA_ONLY = ("kafka.sasl.jaas.config", "kafka.ssl.truststore.", "kafka.ssl.keystore.")


@dataclass(frozen=True)
class Kafka:
    """Where to read: bootstrap servers plus Spark Kafka source options (`kafka.*` for the client).

    `client` holds librdkafka settings for the preflight checks that have no `kafka.*` twin (a SASL
    login is `sasl.username`/`sasl.password` for librdkafka but `kafka.sasl.jaas.config` for Spark).
    """

    bootstrap_servers: str
    options: Mapping[str, str]
    client: Mapping[str, object] = field(default_factory=dict)

    def client_config(self) -> dict[str, object]:
        """A librdkafka config for the preflight checks: bootstrap servers and the `kafka.*` options it knows."""
        config: dict[str, object] = {"bootstrap.servers": self.bootstrap_servers, "logger": _quiet,
                                     "socket.connection.setup.timeout.ms": 5000}
        for key, value in self.options.items():
            if key.startswith(KAFKA_PREFIX) and key != "kafka.bootstrap.servers" and not key.startswith(_JAVA_ONLY):
                config[key.removeprefix(KAFKA_PREFIX)] = value
        config.update(self.client)
        return config

    def spark_options(self) -> dict[str, str]:
        return {"kafka.bootstrap.servers": self.bootstrap_servers, "includeHeaders": "true", **FETCH_DEFAULTS,
                **self.options}

    @property
    def whole_partitions(self) -> bool:
        """Whether Spark reads each Kafka partition (of a batch) into one task, as it does unless told to split."""
        return not any(key.lower() in _SPLITTING for key in self.options)


#: Kafka source options that split one Kafka partition over several tasks.
_SPLITTING = {"minpartitions", "maxrecordsperpartition"}

#: JAAS login modules of the Java client for librdkafka's sasl.mechanism values.
_LOGIN_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}


def security_settings(config: Mapping[str, object]) -> dict[str, object]:
    """The security part of a librdkafka config: security.protocol, sasl.* and ssl.*."""
    return {key: value for key, value in config.items()
            if key == "security.protocol" or key.startswith(("sasl.", "ssl."))}


def java_options(security: Mapping[str, object]) -> dict[str, str]:
    """librdkafka security settings as Spark Kafka source options (the Java client's names).

    Covers TLS with a CA file and a SASL PLAIN or SCRAM login; anything else (client certificates,
    OAUTHBEARER, Kerberos) goes in --kafka-option kafka.... as the Java client names it.
    """
    options: dict[str, str] = {}
    if security.get("security.protocol"):
        options["kafka.security.protocol"] = str(security["security.protocol"]).upper()
    mechanism = str(security.get("sasl.mechanism") or security.get("sasl.mechanisms") or "").upper()
    if mechanism:
        options["kafka.sasl.mechanism"] = mechanism
    if mechanism in _LOGIN_MODULES and "sasl.username" in security and "sasl.password" in security:
        options["kafka.sasl.jaas.config"] = (
            f'{_LOGIN_MODULES[mechanism]} required username="{_jaas(security["sasl.username"])}" '
            f'password="{_jaas(security["sasl.password"])}";')
    if security.get("ssl.ca.location"):
        options["kafka.ssl.truststore.type"] = "PEM"
        options["kafka.ssl.truststore.location"] = str(security["ssl.ca.location"])
    if "ssl.endpoint.identification.algorithm" in security:
        algorithm = str(security["ssl.endpoint.identification.algorithm"])
        options["kafka.ssl.endpoint.identification.algorithm"] = "" if algorithm == "none" else algorithm
    return options


def _jaas(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"')


def _known_config(config: dict[str, object], make: type) -> object:
    """Build a librdkafka client, dropping options that only the Java client knows."""
    config = dict(config)
    while True:
        try:
            return make(config)
        except KafkaException as error:
            text = kafka_reason(error)
            unknown = [key for key in config if f'"{key}"' in text]
            if "No such configuration property" not in text or not unknown:
                raise SourceError(f"bad Kafka option: {text}") from None
            del config[unknown[0]]


def partitions(kafka: Kafka, topics: Sequence[str], timeout: float = 10.0) -> dict[str, list[int]]:
    """Each topic's partition ids; SourceError when Kafka does not answer or a topic does not exist."""
    problems = ConnectionProblems()
    admin = _known_config({**kafka.client_config(), "error_cb": problems.error_cb}, AdminClient)
    try:
        metadata = admin.list_topics(timeout=timeout)  # type: ignore[attr-defined]
    except KafkaException as error:
        text = kafka_reason(error)
        admin.poll(0)  # type: ignore[attr-defined]  # serves the error callbacks: a refused login, a bad certificate
        if problems.hopeless is not None:
            raise SourceError(problems.describe(kafka.bootstrap_servers, text)) from None
        raise SourceError(f"Kafka at {kafka.bootstrap_servers} is unreachable: {text}") from None
    missing = [topic for topic in topics if topic not in metadata.topics]
    if missing:
        raise SourceError(f"no such topic on {kafka.bootstrap_servers}: {', '.join(missing)}")
    found: dict[str, list[int]] = {}
    for topic in topics:
        described = metadata.topics[topic]
        if described.error is not None:
            raise SourceError(f"topic {topic}: {described.error.str()}")
        found[topic] = sorted(described.partitions)
    return found


def watermarks(kafka: Kafka, topics: Mapping[str, Sequence[int]],
               timeout: float = 10.0) -> dict[str, dict[int, tuple[int, int]]]:
    """(low, high) offsets of every partition now: what a batch audit reads."""
    consumer = _known_config({**kafka.client_config(), "group.id": f"outbox-audit-{uuid.uuid4().hex[:8]}",
                              "enable.auto.commit": False}, Consumer)
    try:
        found: dict[str, dict[int, tuple[int, int]]] = {}
        for topic, ids in topics.items():
            found[topic] = {}
            for partition in ids:
                try:
                    low, high = consumer.get_watermark_offsets(  # type: ignore[attr-defined]
                        TopicPartition(topic, partition), timeout=timeout, cached=False)
                except KafkaException as error:
                    text = kafka_reason(error)
                    raise SourceError(f"offsets of {topic}[{partition}]: {text}") from None
                found[topic][partition] = (low, high)
        return found
    finally:
        consumer.close()  # type: ignore[attr-defined]


def read_batch(spark: SparkSession, kafka: Kafka, offsets: Mapping[str, Mapping[int, tuple[int, int]]]) -> DataFrame:
    """The messages between the pinned offsets, as Spark's Kafka source gives them."""
    starting = {topic: {str(p): low for p, (low, _) in parts.items()} for topic, parts in offsets.items()}
    ending = {topic: {str(p): high for p, (_, high) in parts.items()} for topic, parts in offsets.items()}
    return (spark.read.format("kafka").options(**kafka.spark_options())
            .option("subscribe", ",".join(offsets))
            .option("startingOffsets", json.dumps(starting)).option("endingOffsets", json.dumps(ending))
            .load())


def read_stream(spark: SparkSession, kafka: Kafka, topics: Sequence[str],
                max_offsets_per_trigger: int | None = None) -> DataFrame:
    """The topics from their earliest offsets on, as a stream (the checkpoint remembers where it was)."""
    reader = (spark.readStream.format("kafka").options(**kafka.spark_options())
              .option("subscribe", ",".join(topics)).option("startingOffsets", "earliest"))
    if max_offsets_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
    return reader.load()
