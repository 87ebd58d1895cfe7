"""One decision of what is secret (outbox.kafka.redaction), and the masking that follows from it."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from confluent_kafka import Producer

from outbox.harvest.config import HarvestConfig
from outbox.kafka.redaction import (
    LIBRDKAFKA_SENSITIVE,
    REDACTED,
    RedactingFilter,
    is_secret,
    redact_mapping,
    remember_secrets,
    scrub,
    secret_values,
)
from outbox.queue.config import QueueConfig

ROOT = Path(__file__).resolve().parents[2]

#: What the issue names, at least: librdkafka's sensitive properties, libpq's secrets, and names by pattern.
MUST_BE_SECRET = [
    "sasl.username", "sasl.password", "sasl.oauthbearer.config", "sasl.oauthbearer.client.secret",
    "ssl.key.password", "ssl.key.pem", "ssl.key.location", "ssl.ca.pem", "ssl.keystore.password",
    "password", "sslpassword", "PASSWORD", "oauth_client_secret", "scram_client_key",
    "my.api.token", "vault.credentials", "sasl.jaas.config", "x.private.thing", "client.cert.pem", "api_key",
    "SECRET_KEY",
]
NOT_SECRET = ["bootstrap.servers", "security.protocol", "sasl.mechanism", "ssl.ca.location", "compression.type",
              "host", "user", "dbname", "sslmode", "passfile", "client.id", "batch.size", "keys"]


@pytest.mark.parametrize("name", MUST_BE_SECRET)
def test_secret_names(name):
    assert is_secret(name)


@pytest.mark.parametrize("name", NOT_SECRET)
def test_ordinary_names(name):
    assert not is_secret(name)


def test_every_listed_librdkafka_property_is_known_to_the_installed_librdkafka():
    # A property this librdkafka does not know would make the list stale (or mistyped): it raises
    # "No such configuration property". ssl_key is librdkafka's internal name, set through the C API only.
    settings = {name: f"marker-{index}" for index, name in enumerate(sorted(LIBRDKAFKA_SENSITIVE - {"ssl_key"}))}
    producer = Producer({"bootstrap.servers": "127.0.0.1:1", **settings, "logger": logging.getLogger("quiet"),
                         "error_cb": lambda _error: None})
    producer.flush(0)


def test_mappings_are_masked_at_any_depth():
    settings = {"base_kafka_config": {"sasl.password": "p1", "bootstrap.servers": "b:1"},
                "DATABASES": {"default": {"PASSWORD": "p2", "OPTIONS": {"sslpassword": "p3", "sslmode": "require"}}},
                "dsn": "postgres://u:p4@h/db", "list": [{"token": "p5"}]}
    masked = redact_mapping(settings)
    assert masked["base_kafka_config"] == {"sasl.password": REDACTED, "bootstrap.servers": "b:1"}
    assert masked["DATABASES"]["default"] == {"PASSWORD": REDACTED, "OPTIONS": {"sslpassword": REDACTED,
                                                                                  "sslmode": "require"}}
    assert "p4" not in masked["dsn"] and masked["list"] == [{"token": REDACTED}]
    assert secret_values(settings) == {"p1", "p2", "p3", "p4", "p5"}


def test_config_objects_print_no_secret():
    harvest = HarvestConfig(dsn="host=h password=pw-1 sslpassword=pw-2 dbname=d",
                            base_kafka_config={"bootstrap.servers": "b:1", "ssl.key.pem": "pw-3",
                                               "sasl.oauthbearer.config": "clientSecret=pw-4"},
                            producer_kafka_config={"ssl.keystore.password": "pw-5"})
    queue = QueueConfig(base_kafka_config={"bootstrap.servers": "b:1", "sasl.username": "pw-6"})
    text = f"{harvest!r} {harvest.redacted()} {queue!r} {queue.redacted()}"
    assert "pw-" not in text and "b:1" in text


def test_scrub_masks_values_wherever_they_turn_up():
    assert scrub("login as alice with hunter22 failed", {"hunter22"}) == "login as alice with *** failed"
    assert scrub("harvesting outbox", {"outbox"}) == "harvesting outbox"  # too short to scrub from free text


def test_the_log_filter_masks_remembered_secrets_in_messages_and_tracebacks():
    remember_secrets({"sasl.password": "filter-secret-1"})
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactingFilter())
    logger = logging.getLogger("tests.redaction")
    logger.addHandler(handler)
    try:
        logger.warning("connecting with %s", "filter-secret-1")
        try:
            raise RuntimeError("refused filter-secret-1")
        except RuntimeError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    assert "filter-secret-1" not in stream.getvalue() and "connecting with ***" in stream.getvalue()


def test_a_django_process_masks_its_settings_secrets_from_the_start(tmp_path):
    """Any process of the project (a web server, a shell), not only one that builds a harvester: the app remembers
    OUTBOX's and DATABASES' secrets when Django starts, and the log filter masks them (a fresh process: this one
    remembered others' long ago)."""
    (tmp_path / "secret_settings.py").write_text(
        "from project.settings import *  # noqa\n"
        "OUTBOX = {**OUTBOX, 'base_kafka_config': {'bootstrap.servers': '127.0.0.1:9', 'sasl.password': "
        "'s3cret-pass-Xy9'}}\n"
        "DATABASES['default'] = {**DATABASES['default'], 'PASSWORD': 'db-pass-Qw7e'}\n")
    said = ("import django, logging; django.setup(); from outbox.kafka.redaction import RedactingFilter; "
            "record = logging.LogRecord('app', logging.INFO, 'app.py', 1, 'with %s and %s', "
            "('s3cret-pass-Xy9', 'db-pass-Qw7e'), None); RedactingFilter().filter(record); print(record.getMessage())")
    done = subprocess.run([sys.executable, "-c", said], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "DJANGO_SETTINGS_MODULE": "secret_settings",
                               "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
    assert done.returncode == 0 and done.stdout.strip() == f"with {REDACTED} and {REDACTED}", done.stdout + done.stderr
