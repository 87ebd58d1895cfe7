"""`manage.py outbox_consume`, `outbox_redeliver` and `check` as an operator meets them: one-line errors."""

from __future__ import annotations

import json

import pytest

from tests.support.commands import ROOT, manage

# the commands' flags and one-line errors: the same on any PostgreSQL (not in make test-postgres18)
pytestmark = [pytest.mark.postgres_agnostic]

CONSUME = ["outbox_consume", "--queue", "emails", "--handler", "project.shop.handlers.confirm_order"]


def one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    return lines[0]


def test_a_handler_that_cannot_be_imported_is_one_line():
    result = manage("outbox_consume", "--queue", "emails", "--handler", "project.shop.handlers.nope")
    assert one_line(result).startswith("CommandError: --handler: cannot import 'project.shop.handlers.nope'")


@pytest.mark.parametrize(("flags", "message"), [
    (["--queue", "a/b"], "CommandError: --queue: must be 1-200 characters of a-z A-Z 0-9 . _ -"),
    (["--workers", "11"], "CommandError: --workers: must be from 1 to max_in_progress (10), got 11"),
    (["--redelivery-timeout", "0"], "CommandError: --redelivery-timeout: must be between 0.1 and 43200 seconds"),
    (["--max-deliveries", "0"], "CommandError: --max-deliveries: must be a positive integer or None, got 0"),
    (["--inbox", "--database", "other"],
     "CommandError: --database: must name an entry of DATABASES, got 'other' (DATABASES has 'default')"),
])


def test_bad_flags_are_one_line_naming_the_flag_and_the_limit(flags, message):
    assert one_line(manage(*CONSUME, *flags)).startswith(message)


@pytest.mark.integration
@pytest.mark.parametrize("command", [CONSUME, ["outbox_redeliver"]])
def test_unreachable_kafka_is_one_line_and_non_zero(command, database_url):
    result = manage(*command, env={"DATABASE_URL": database_url, "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    assert one_line(result).startswith("CommandError: Kafka is unreachable at 127.0.0.1:1")


def test_print_config_redacts_secrets(tmp_path):
    (tmp_path / "sasl_settings.py").write_text(
        "from project.settings import *  # noqa\n"
        "OUTBOX = {**OUTBOX, 'base_kafka_config': {'bootstrap.servers': 'k:9093', 'sasl.password': 'sasl-s3cret'}}\n")
    result = manage("outbox_redeliver", "--print-config",
                    env={"DJANGO_SETTINGS_MODULE": "sasl_settings", "PYTHONPATH": f"{tmp_path}:{ROOT}"})
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    assert "sasl-s3cret" not in result.stdout and config["base_kafka_config"]["sasl.password"] == "***"
    assert config["limits"] == {"redelivery_timeout": 30.0, "keep_alive_interval": 10.0, "max_in_progress": 10,
                                "max_deliveries": 5, "backend": "markers"}


def test_check_fails_with_a_queue_error_code_on_a_bad_setting(tmp_path):
    (tmp_path / "bad_settings.py").write_text(
        "from project.settings import *  # noqa\n"
        "OUTBOX = {**OUTBOX, 'queues': {**OUTBOX['queues'], 'max_delivries': 3, 'keep_alive_interval': 60}}\n")
    result = manage("check", env={"DJANGO_SETTINGS_MODULE": "bad_settings", "PYTHONPATH": f"{tmp_path}:{ROOT}"})
    assert result.returncode != 0
    assert "outbox_queue.E002" in result.stderr and "did you mean 'max_deliveries'" in result.stderr
    assert "outbox_queue.E004" not in result.stderr, "one kind of problem at a time: unknown keys first"
    assert "OUTBOX['queues']['max_delivries'] is not a known setting" in result.stderr
    result = manage("outbox_consume", "--queue", "q", "--handler", "x.y",
                    env={"DJANGO_SETTINGS_MODULE": "bad_settings", "PYTHONPATH": f"{tmp_path}:{ROOT}"})
    assert result.returncode == 1 and "outbox_queue.E002" in result.stderr, "commands run the system checks first"


@pytest.mark.parametrize("command", [[*CONSUME, "--inbox"], ["outbox_redeliver"]])
def test_unreachable_postgres_is_one_line_and_non_zero(command):
    result = manage(*command, env={"DATABASE_URL": "postgres://outbox:outbox@127.0.0.1:1/outbox"})
    assert one_line(result).startswith("CommandError: cannot connect to Postgres at 127.0.0.1:1/outbox: ")


@pytest.mark.integration
def test_an_unmigrated_database_is_one_line(services):
    import uuid

    import psycopg

    name = f"outbox_unmigrated_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(services.database_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name}")
        conn.execute(f"CREATE DATABASE {name}")
    try:
        result = manage("outbox_redeliver", env={"DATABASE_URL": services.database_url_for(name)})
        assert "run manage.py migrate outbox_queue" in one_line(result)
    finally:
        services.drop_database(name)
