"""`manage.py harvest` and `check` as an operator runs them: exit codes and one-line errors."""

from __future__ import annotations

import json

import pytest

from tests.support.commands import ROOT, manage

# the command's flags and one-line errors: the same on any PostgreSQL (not in make test-postgres18)
pytestmark = [pytest.mark.postgres_agnostic]


def test_print_config_redacts_secrets():
    result = manage("harvest", "--print-config", "--max-in-flight-records", "7",
                    env={"DATABASE_URL": "postgres://u:db-s3cret@db.example:5432/shop"})
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    assert "db-s3cret" not in result.stdout and "password=***" in config["dsn"]
    assert config["limits"]["max_in_flight_records"] == 7
    assert config["limits"]["max_poll_interval"] == 2.5


@pytest.mark.integration
def test_unreachable_postgres_is_one_line_and_non_zero():
    result = manage("harvest", env={"DATABASE_URL": "postgres://outbox:outbox@127.0.0.1:1/outbox"})
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert lines == [lines[-1]] and lines[0].startswith("CommandError: cannot connect to Postgres at 127.0.0.1:1/")


@pytest.mark.integration
@pytest.mark.django_db
def test_unreachable_kafka_is_one_line_and_non_zero(database_url):
    result = manage("harvest", env={"DATABASE_URL": database_url, "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("CommandError: Kafka is unreachable at 127.0.0.1:1"), lines


def test_bad_table_flag_is_refused():
    result = manage("harvest", "--table", "x; DROP TABLE y")
    assert result.returncode != 0 and "table" in result.stderr


def test_check_fails_with_an_error_code_on_a_bad_setting(tmp_path):
    (tmp_path / "bad_settings.py").write_text(
        "from project.settings import *  # noqa\n"
        "OUTBOX = {**OUTBOX, 'max_in_flight_recods': 10, 'queue_timeout': -1}\n")
    result = manage("check", env={"DJANGO_SETTINGS_MODULE": "bad_settings", "PYTHONPATH": f"{tmp_path}:{ROOT}"})
    assert result.returncode != 0
    assert "outbox.E002" in result.stderr and "did you mean 'max_in_flight_records'" in result.stderr
    assert "outbox.E004" in result.stderr and "queue_timeout" in result.stderr


def test_check_passes_on_the_example_project():
    result = manage("check", "--fail-level", "WARNING")
    assert result.returncode == 0, result.stderr


def test_an_unknown_database_names_itself_and_the_aliases_there_are():
    result = manage("harvest", "--database", "nope")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "CommandError: --database: must name an entry of DATABASES, got 'nope' (DATABASES has 'default')"]


def test_print_config_of_an_invalid_configuration_prints_it_then_fails_even_with_skip_checks(tmp_path):
    (tmp_path / "invalid_settings.py").write_text(
        "from project.settings import *  # noqa\n"
        "OUTBOX = {**OUTBOX, 'max_in_flight_records': 0, 'leader_topic': 'bad topic!'}\n")
    result = manage("harvest", "--print-config", "--skip-checks",
                    env={"DJANGO_SETTINGS_MODULE": "invalid_settings", "PYTHONPATH": f"{tmp_path}:{ROOT}"})
    assert result.returncode == 1
    assert json.loads(result.stdout)["limits"]["max_in_flight_records"] == 0, "printed first"
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("CommandError: invalid configuration: ") and "max_in_flight_records: must be at least 1" \
        in line and "leader_topic: must be a Kafka topic name" in line


def test_a_bad_flag_is_one_problem_on_that_flag_not_on_the_limits_derived_from_it():
    """--heartbeat-timeout -1 alone: max_poll_interval, drain_interval and delivery_timeout derive from it and were
    never set, so they are not reported as well."""
    result = manage("harvest", "--heartbeat-timeout", "-1")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "CommandError: invalid configuration: heartbeat_timeout: must be at least 0.001, got -1.0"]


def test_a_bad_flag_with_several_outboxes_is_refused_at_once(tmp_path):
    """With OUTBOX["outboxes"], --heartbeat-timeout -1 used to start the process and fail every engine's start
    for ever (with a backoff); it is refused as for one outbox, and --print-config names each outbox's problem once."""
    (tmp_path / "many_settings.py").write_text(
        "from project.settings import *  # noqa\n"
        "OUTBOX = {**OUTBOX, 'outboxes': {'shop': {'database': 'default', 'table': 'outbox'}}}\n")
    env = {"DJANGO_SETTINGS_MODULE": "many_settings", "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    result = manage("harvest", "--heartbeat-timeout", "-1", env=env, timeout=30)
    assert (result.returncode, result.stderr.strip().splitlines()) == (
        1, ["CommandError: invalid configuration: heartbeat_timeout: must be at least 0.001, got -1.0"])
    printed = manage("harvest", "--heartbeat-timeout", "-1", "--print-config", env=env, timeout=30)
    assert printed.returncode == 1 and json.loads(printed.stdout)["shop"]["limits"]["heartbeat_timeout"] == -1
    assert printed.stderr.strip().splitlines() == [
        "CommandError: invalid configuration: shop: heartbeat_timeout: must be at least 0.001, got -1.0"]
    (tmp_path / "typo_settings.py").write_text("from many_settings import *  # noqa\n"
                                               "OUTBOX = {**OUTBOX, 'heartbeat_timout': 3}\n")
    typo = manage("harvest", "--print-config", "--skip-checks", timeout=30,
                  env={**env, "DJANGO_SETTINGS_MODULE": "typo_settings"})
    assert typo.returncode == 1 and "heartbeat_timout: is not a known setting" in typo.stderr, "printed, then refused"


@pytest.mark.parametrize("command", ["harvest", "outbox_redeliver", "outbox_consume"])
def test_a_name_with_a_control_character_is_refused_in_one_line(command):
    extra = ["--queue", "q", "--handler", "tests.support.queue_handlers.record"] if command == "outbox_consume" else []
    result = manage(command, "--name", "replica-1\nFORGED 2026-01-01 ERROR outbox: all is lost", *extra)
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("CommandError: --name: must not contain control characters"), line
