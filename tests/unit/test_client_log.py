"""librdkafka's own log lines, as the outbox's clients hand them to Python logging (outbox.kafka.clients)."""

from __future__ import annotations

import logging

import pytest

from outbox.kafka.clients import client_log

GETPID = ("[thrd:main]: Failed to acquire idempotence PID from broker 127.0.0.1:9092/1: Broker: Coordinator load in "
          "progress: retrying")


def lines(caplog: pytest.LogCaptureFixture, level: int, fac: str, text: str) -> list[tuple[str, str]]:
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=client_log.name):
        client_log.log(level, "%s [%s] %s", "rdkafka#producer-1", fac, text)
    return [(record.levelname, record.getMessage()) for record in caplog.records]


def test_a_coordinator_still_loading_is_said_at_info_and_other_warnings_stay_warnings(caplog):
    assert lines(caplog, logging.WARNING, "GETPID", GETPID) == [("INFO", f"rdkafka#producer-1 [GETPID] {GETPID}")]
    refused = GETPID.replace("Coordinator load in progress", "Cluster authorization failed")
    assert lines(caplog, logging.WARNING, "GETPID", refused)[0][0] == "WARNING"


def test_the_gapless_guarantee_warning_is_dropped(caplog):
    text = "[thrd:app]: Configuration property enable.gapless.guarantee is experimental"
    assert lines(caplog, logging.WARNING, "CONFWARN", text) == []
    assert lines(caplog, logging.WARNING, "CONFWARN", "[thrd:app]: something else")[0][0] == "WARNING"
