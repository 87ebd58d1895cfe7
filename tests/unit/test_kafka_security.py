"""Kafka security settings without a broker: one-line connection errors, the audit's Spark options,
the example project's environment variables, and the leader election's socket timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from outbox.harvest import kafka
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.kafka import ConnectionProblems, heartbeat_producer_config, leader_consumer_config
from outbox.kafka.clients import KafkaUnavailable
from outbox.pipeline.sources import java_options, security_settings

ROOT = Path(__file__).resolve().parents[2]
BOOTSTRAP = "b1:9093,b2:9093"


def problems(*errors: tuple[int, str]) -> ConnectionProblems:
    found = ConnectionProblems()
    for code, text in errors:
        found.error_cb(KafkaError(code, text))
    return found


def test_a_refused_login_is_named_without_broker_prefix_or_state():
    seen = problems(
        (KafkaError._TRANSPORT, "sasl_ssl://b1:9093/bootstrap: Connect to ipv4#10.0.0.1:9093 failed: Connection "
                                "refused (after 0ms in state CONNECT)"),
        (KafkaError._AUTHENTICATION, "sasl_ssl://b2:9093/bootstrap: SASL authentication error: Authentication failed "
                                     "during authentication due to invalid credentials with SASL mechanism "
                                     "SCRAM-SHA-512 (after 308ms in state AUTH_REQ)"),
    )
    assert seen.hopeless is not None
    assert seen.describe(BOOTSTRAP, "Local: Broker transport failure") == (
        "Kafka at b1:9093,b2:9093 refused the login: SASL authentication error: Authentication failed during "
        "authentication due to invalid credentials with SASL mechanism SCRAM-SHA-512")


def test_an_untrusted_certificate_is_a_tls_failure():
    seen = problems((KafkaError._SSL, "ssl://b1:9093/bootstrap: SSL handshake failed: certificate verify failed "
                                      "(after 3ms in state SSL_HANDSHAKE)"))
    assert seen.describe(BOOTSTRAP, "x") == "TLS with Kafka at b1:9093,b2:9093 failed: SSL handshake failed: " \
                                            "certificate verify failed"


def test_an_unreachable_cluster_says_why_or_falls_back_to_the_calls_own_error():
    refused = problems((KafkaError._TRANSPORT, "b1:9093/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection "
                                               "refused (after 0ms in state CONNECT)"),
                       (KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))
    assert refused.hopeless is None, "retrying may help: the broker may come up"
    assert refused.describe("b1:9093", "Local: Broker transport failure") == \
        "Kafka is unreachable at b1:9093: Connect to ipv4#127.0.0.1:1 failed: Connection refused"
    assert problems().describe("b1:9093", "Local: Timed out") == "Kafka is unreachable at b1:9093: Local: Timed out"


class SlowAdmin:
    """An AdminClient whose metadata requests fail with `code` until `answers_at` seconds on its own clock (each
    request spends its timeout), as a loaded broker (timed out) or one not up at all (transport failure) would."""

    def __init__(self, code: int, answers_at: float) -> None:
        self.code, self.answers_at, self.now = code, answers_at, 0.0

    def monotonic(self) -> float:
        return self.now

    def list_topics(self, timeout: float) -> str:
        if self.now >= self.answers_at:
            return "metadata"
        self.now += timeout
        raise KafkaException(KafkaError(self.code, "Failed to get metadata"))

    def poll(self, timeout: float) -> int:
        return 0


@pytest.fixture
def admin(monkeypatch: pytest.MonkeyPatch):
    def install(code: int, answers_at: float) -> SlowAdmin:
        fake = SlowAdmin(code, answers_at)
        monkeypatch.setattr(kafka, "AdminClient", lambda config: fake)
        monkeypatch.setattr(kafka, "time", fake)
        return fake
    return install


def test_a_broker_that_is_up_but_slow_is_waited_for_longer_than_one_that_is_not_up(admin, caplog):
    slow = admin(KafkaError._TIMED_OUT, answers_at=25.0)
    assert kafka.cluster_metadata({"bootstrap.servers": "b1:9093"}, timeout=10.0) == "metadata"
    assert "Kafka at b1:9093 is up but has not answered for 10s: waiting up to 60s" in caplog.text
    assert slow.now == 25.0

    silent = admin(KafkaError._TIMED_OUT, answers_at=float("inf"))
    with pytest.raises(KafkaUnavailable, match="Kafka is unreachable at b1:9093: Failed to get metadata"):
        kafka.cluster_metadata({"bootstrap.servers": "b1:9093"}, timeout=10.0)
    assert silent.now == 60.0, "a slow broker's patience ends too"

    down = admin(KafkaError._TRANSPORT, answers_at=25.0)
    with pytest.raises(KafkaUnavailable, match="Kafka is unreachable at b1:9093"):
        kafka.cluster_metadata({"bootstrap.servers": "b1:9093"}, timeout=10.0)
    assert down.now == 10.0, "no broker up: unreachable after the timeout"


def test_librdkafka_security_settings_become_the_java_clients_for_spark():
    config = {"bootstrap.servers": BOOTSTRAP, "security.protocol": "sasl_ssl", "sasl.mechanism": "SCRAM-SHA-512",
              "sasl.username": "outbox", "sasl.password": 'p"w\\d', "ssl.ca.location": "/etc/kafka/ca.pem",
              "linger.ms": 5}
    security = security_settings(config)
    assert set(security) == {"security.protocol", "sasl.mechanism", "sasl.username", "sasl.password",
                             "ssl.ca.location"}, "only the security part goes to the audit's clients"
    assert java_options(security) == {
        "kafka.security.protocol": "SASL_SSL",
        "kafka.sasl.mechanism": "SCRAM-SHA-512",
        "kafka.sasl.jaas.config": 'org.apache.kafka.common.security.scram.ScramLoginModule required '
                                  'username="outbox" password="p\\"w\\\\d";',
        "kafka.ssl.truststore.type": "PEM",
        "kafka.ssl.truststore.location": "/etc/kafka/ca.pem",
    }


def test_plain_login_and_hostname_checks_off():
    options = java_options({"security.protocol": "SASL_PLAINTEXT", "sasl.mechanisms": "PLAIN", "sasl.username": "u",
                            "sasl.password": "p", "ssl.endpoint.identification.algorithm": "none"})
    assert options["kafka.sasl.jaas.config"].startswith("org.apache.kafka.common.security.plain.PlainLoginModule ")
    assert options["kafka.ssl.endpoint.identification.algorithm"] == ""
    assert java_options({}) == {}, "a plaintext cluster needs no options"


def test_the_example_project_reads_kafka_security_from_the_environment():
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings", "KAFKA_BOOTSTRAP_SERVERS": BOOTSTRAP,
           "KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "SCRAM-SHA-256",
           "KAFKA_SASL_USERNAME": "shop", "KAFKA_SASL_PASSWORD": "s3cret-from-env", "KAFKA_SSL_CA_LOCATION": "/ca.pem"}
    code = "from django.conf import settings; print(sorted(settings.OUTBOX['base_kafka_config'].items()))"
    result = subprocess.run([sys.executable, "-c", f"import django; django.setup(); {code}"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(sorted({
        "bootstrap.servers": BOOTSTRAP, "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-256",
        "sasl.username": "shop", "sasl.password": "s3cret-from-env", "ssl.ca.location": "/ca.pem"}.items()))
    env = {key: value for key, value in env.items() if not key.startswith(("KAFKA_S",))}
    result = subprocess.run([sys.executable, "-c", f"import django; django.setup(); {code}"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == str([("bootstrap.servers", BOOTSTRAP)]), "unset variables add nothing"


def test_election_clients_give_up_on_a_hung_broker_within_two_heartbeat_timeouts():
    config = HarvestConfig(dsn="dbname=x", limits=Limits(heartbeat_timeout=5.0))
    assert leader_consumer_config(config)["socket.timeout.ms"] == 10_000
    assert heartbeat_producer_config(config)["socket.timeout.ms"] == 10_000
    custom = HarvestConfig(dsn="dbname=x", base_kafka_config={"bootstrap.servers": "b:1", "socket.timeout.ms": 30_000})
    assert leader_consumer_config(custom)["socket.timeout.ms"] == 30_000, "an explicit setting wins"


class TopicJustMade(SlowAdmin):
    """A cluster where another replica has just made `topic` with three partitions: the first metadata shows it
    without them (its leaders not yet elected), and creating it again says it exists."""

    def __init__(self, topic: str, shown_after: int) -> None:
        super().__init__(KafkaError._TIMED_OUT, answers_at=0.0)
        self.topic, self.shown_after, self.asked = topic, shown_after, 0

    def list_topics(self, timeout: float) -> SimpleNamespace:
        self.asked += 1
        ready = self.asked > self.shown_after
        shown = SimpleNamespace(error=None if ready else KafkaError(KafkaError.LEADER_NOT_AVAILABLE),
                                partitions=dict.fromkeys(range(3)) if ready else {})
        return SimpleNamespace(topics={self.topic: shown})

    def create_topics(self, topics: list[Any], request_timeout: float) -> dict[str, Any]:
        def exists(timeout: float) -> None:
            raise KafkaException(KafkaError(KafkaError.TOPIC_ALREADY_EXISTS, "Topic already exists"))
        return {self.topic: SimpleNamespace(result=exists)}

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_leader_topic_another_replica_just_made_counts_the_partitions_it_has_not_the_ones_asked_for(monkeypatch):
    cluster = TopicJustMade("leader", shown_after=3)
    monkeypatch.setattr(kafka, "AdminClient", lambda config: cluster)
    monkeypatch.setattr(kafka, "time", cluster)
    assert kafka.ensure_topic({"bootstrap.servers": "b1:9093"}, "leader", timeout=10.0, partitions=2) == 3, \
        "a replica of 2 shards must find the 3 partitions, and refuse to start"

    never = TopicJustMade("leader", shown_after=10**6)
    monkeypatch.setattr(kafka, "AdminClient", lambda config: never)
    monkeypatch.setattr(kafka, "time", never)
    with pytest.raises(KafkaUnavailable, match="leader topic 'leader' exists at b1:9093 but its partitions were not "
                                               "known within 10s"):
        kafka.ensure_topic({"bootstrap.servers": "b1:9093"}, "leader", timeout=10.0, partitions=2)
