"""The unit tests' own fixtures (no services here)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _a_broker_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings a test builds without base_kafka_config still name a broker, as an application's environment does
    (else every check says so: outbox.W006); the tests of that warning take the variable away."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
