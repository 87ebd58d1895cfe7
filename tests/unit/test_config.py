"""The engine's config and the Django settings that build it: defaults, validation, redaction."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from datetime import timedelta

import pytest
from django.core import checks
from django.test import override_settings
from psycopg.conninfo import conninfo_to_dict

from outbox import conf
from outbox.harvest.config import HarvestConfig, Limits
from outbox.kafka.redaction import redact_dsn


def test_derived_limits_follow_goharvest():
    limits = Limits()
    assert limits.max_poll_interval == 2.5  # heartbeat_timeout / 2
    assert limits.drain_interval == 2.5  # min(max_poll_interval, queue_timeout)
    assert Limits(heartbeat_timeout=1.0, queue_timeout=0.2).drain_interval == 0.2


def test_every_problem_is_reported_at_once():
    config = HarvestConfig(dsn="", table="bad table", leader_topic="no spaces", leader_group="",
                           base_kafka_config={}, limits=Limits(max_in_flight_records=0, queue_timeout="soon"))
    found = {(p.code, p.field) for p in config.validate()}
    assert found >= {("E005", "dsn"), ("E006", "table"), ("E007", "leader_topic"), ("E008", "leader_group"),
                     ("E010", "base_kafka_config"), ("E004", "max_in_flight_records"), ("E003", "queue_timeout")}


@pytest.mark.parametrize("table", ["outbox", "sales.outbox", "_t1", "a" * 63])
def test_table_names_accepted(table):
    assert not HarvestConfig(dsn="x", table=table).validate()


@pytest.mark.parametrize("table", ["1abc", "a.b.c", "out box", "x; DROP TABLE y", '"q"', "a" * 64, ""])
def test_table_names_refused(table):
    assert [p.code for p in HarvestConfig(dsn="x", table=table).validate()] == ["E006"]


@pytest.mark.parametrize(("dsn", "expected"), [
    ("postgres://u:s3cret@h:5432/db", {"user": "u", "password": "***", "host": "h", "port": "5432", "dbname": "db"}),
    ("host=h password=s3cret dbname=d", {"host": "h", "password": "***", "dbname": "d"}),
    ("host=h password='s3 cret' dbname=d", {"host": "h", "password": "***", "dbname": "d"}),
    ("postgres://u@h/db?sslpassword=s3cret&sslmode=require",
     {"user": "u", "host": "h", "dbname": "db", "sslpassword": "***", "sslmode": "require"}),
    ("postgresql:///db?host=/run&password=s3cret", {"host": "/run", "dbname": "db", "password": "***"}),
])
def test_dsn_secrets_are_redacted(dsn, expected):
    redacted = redact_dsn(dsn)
    assert "s3" not in redacted and conninfo_to_dict(redacted) == expected


@pytest.mark.parametrize("dsn", ["postgres://u@h/db", "host=h dbname=d sslmode=require"])
def test_dsn_without_secrets_is_shown_as_written(dsn):
    assert redact_dsn(dsn) == dsn


def test_unparseable_dsn_is_masked_whole():
    assert redact_dsn("host=h password='s3cret") == "***"


def test_redacted_config_hides_every_secret():
    config = HarvestConfig(
        dsn="postgres://u:dsn-secret@h/db",
        base_kafka_config={"bootstrap.servers": "b:9092", "sasl.password": "sasl-secret",
                           "sasl.oauthbearer.client.secret": "oauth-secret", "security.protocol": "SASL_SSL"},
        producer_kafka_config={"ssl.key.password": "key-secret", "compression.type": "lz4"},
    )
    text = f"{config.redacted()} {config!r}"
    for secret in ("dsn-secret", "sasl-secret", "oauth-secret", "key-secret"):
        assert secret not in text
    assert "SASL_SSL" in text and "lz4" in text


def outbox_errors(**outbox) -> list[str]:
    with override_settings(OUTBOX=outbox):
        return [m.id for m in checks.run_checks(tags=["outbox"])]


def test_default_settings_pass_the_checks():
    assert outbox_errors() == []


@pytest.mark.parametrize(("outbox", "code"), [
    ({"max_in_flight_recods": 5}, "outbox.E002"),
    ({"max_in_flight_records": 0}, "outbox.E004"),
    ({"heartbeat_timeout": 1201}, "outbox.E004"),
    ({"heartbeat_timeout": "5s"}, "outbox.E003"),
    ({"max_value_bytes": -1}, "outbox.E003"),
    ({"listen": "yes"}, "outbox.E003"),
    ({"table": "bad name"}, "outbox.E006"),
    ({"leader_topic": "bad topic"}, "outbox.E007"),
    ({"database": "missing"}, "outbox.E011"),
    ({"database": ["default"]}, "outbox.E011"),
])
def test_bad_settings_fail_the_checks_with_a_code(outbox, code):
    assert code in outbox_errors(**outbox)


@pytest.mark.parametrize("outbox", [{"heartbeat_timeout": -1}, {"heartbeat_timeout": "5s"}, {"queue_timeout": 0}])
def test_a_bad_limit_is_reported_once_not_on_the_limits_derived_from_it(outbox):
    with override_settings(OUTBOX=outbox):
        messages = checks.run_checks(tags=["outbox"])
    assert [m.msg.split("]")[0] for m in messages] == [f"OUTBOX[{key!r}" for key in outbox]


def test_typo_suggests_the_real_name():
    with override_settings(OUTBOX={"mark_query_record": 5}):
        [message] = checks.run_checks(tags=["outbox"])
    assert "did you mean 'mark_query_records'" in message.msg


def test_settings_build_the_engine_config():
    with override_settings(OUTBOX={"heartbeat_timeout": timedelta(seconds=3), "leader_topic": "t",
                                   "base_kafka_config": {"bootstrap.servers": "k:1"}}):
        config = conf.harvest_config(max_in_flight_records=7, leader_group=None)
    assert config.limits.heartbeat_timeout == 3.0 and config.limits.max_poll_interval == 1.5
    assert config.limits.max_in_flight_records == 7
    assert config.leader_topic == "t" and config.leader_group.startswith("outbox-leader.")
    assert config.base_kafka_config["bootstrap.servers"] == "k:1"
    assert "dbname=" in config.dsn


def test_the_engine_imports_no_django():
    code = ("import sys, outbox.harvest.harvester, outbox.harvest.fakes, outbox.harvest.status; "
            "print(sorted(m for m in sys.modules if m == 'django' or m.startswith('django.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_delivery_timeout_too_long_for_safe_fail_over_is_a_warning():
    # librdkafka's own delivery timeout may be set only with one record per key in flight (E014 otherwise).
    one_per_key = {"max_in_flight_per_key": 1}
    with override_settings(OUTBOX={**one_per_key, "producer_kafka_config": {"delivery.timeout.ms": 20000}}):
        messages = checks.run_checks(tags=["outbox"])
    assert [(m.id, m.level) for m in messages] == [("outbox.W001", checks.WARNING)]
    with override_settings(OUTBOX={"delivery_timeout": 20}):
        messages = checks.run_checks(tags=["outbox"])
    assert [(m.id, m.level) for m in messages] == [("outbox.W001", checks.WARNING)]
    with override_settings(OUTBOX={**one_per_key, "producer_kafka_config": {"delivery.timeout.ms": 7500}}):
        assert checks.run_checks(tags=["outbox"]) == []


def test_the_engine_sql_matches_the_models():
    import re

    from outbox.harvest import contract, status_board
    from outbox.models import DeadLetter, HarvesterStatus, OutboxRecord

    outbox_columns = {f.column for f in OutboxRecord._meta.get_fields()}
    assert set(contract.COLUMNS) | set(contract.FAILURE_COLUMNS) == outbox_columns
    read = re.search(r"SELECT (.*?) FROM", contract.MARK, re.S).group(1).replace(" ", "").split(",")
    assert read == [*contract.COLUMNS, "xmin::text::bigint"]
    parked = re.search(r"INSERT INTO \{dead_letters\} \((.*?)\)", contract.PARK, re.S).group(1)
    assert {c.strip() for c in parked.split(",")} == {f.column for f in DeadLetter._meta.get_fields()} - {"id"}
    inserted = re.search(r"INSERT INTO \{table\} \((.*?)\)", status_board.UPSERT_MANY_SHARDS, re.S).group(1)
    columns = {f.column for f in HarvesterStatus._meta.get_fields()}
    assert {c.strip() for c in inserted.split(",")} == columns
    assert set(re.findall(r"(\w+) = EXCLUDED", status_board.UPSERT_MANY_SHARDS)) == columns - {"name", "started",
                                                                                             "last_seen"}


@pytest.mark.parametrize(("outbox", "code", "text"), [
    ({"producer_kafka_config": "lz4"}, "outbox.E009", "OUTBOX['producer_kafka_config'] must be a mapping"),
    ({"base_kafka_config": "127.0.0.1:9092"}, "outbox.E009", "OUTBOX['base_kafka_config'] must be a mapping"),
    ({"producer_kafka_config": {"compresion.type": "lz4"}}, "outbox.E013",
     "OUTBOX['producer_kafka_config'] is refused by librdkafka: No such configuration property: \"compresion.type\""),
    ({"base_kafka_config": {"security.protocol": "carrier-pigeon"}}, "outbox.E013",
     "OUTBOX['base_kafka_config'] is refused by librdkafka"),
    # librdkafka names the alias (compression.codec), not the key written: the setting is still the one refused.
    ({"producer_kafka_config": {"compression.type": "lz5"}}, "outbox.E013",
     "OUTBOX['producer_kafka_config'] is refused by librdkafka: Invalid value \"lz5\" for configuration property "
     "\"compression.codec\""),
    ({"base_kafka_config": {"compression.type": "lz5"}}, "outbox.E013",
     "OUTBOX['base_kafka_config'] is refused by librdkafka: Invalid value \"lz5\""),
    # Once, not for each client; naming the file, which librdkafka's "BIO lib" does not (a file TLS does not use, with
    # a plaintext protocol, is no problem: tests/acceptance/test_secrets.py plants such paths).
    ({"base_kafka_config": {"security.protocol": "ssl", "ssl.ca.location": "/nonexistent/ca.pem"}}, "outbox.E013",
     "OUTBOX['base_kafka_config'] 'ssl.ca.location' names '/nonexistent/ca.pem', which does not exist"),
    ({"producer_kafka_config": {"security.protocol": "ssl", "ssl.certificate.location": "/nonexistent/client.pem"}},
     "outbox.E013",
     "OUTBOX['producer_kafka_config'] 'ssl.certificate.location' names '/nonexistent/client.pem', which does not"),
    ({"producer_kafka_config": {"enable.idempotence": False}}, "outbox.E014",
     "OUTBOX['producer_kafka_config'] enable.idempotence must stay true"),
    ({"max_in_flight_per_key": 8, "producer_kafka_config": {"delivery.timeout.ms": 5000}}, "outbox.E014",
     "OUTBOX['producer_kafka_config'] delivery.timeout.ms must not be set when max_in_flight_per_key > 1"),
    ({"park_after": 0}, "outbox.E004", "OUTBOX['park_after'] must be a positive integer or None, got 0"),
    ({"shards": 0}, "outbox.E017", "OUTBOX['shards'] must be a whole number from 1 to 256, got 0"),
    ({"shards": "4"}, "outbox.E017", "OUTBOX['shards'] must be a whole number from 1 to 256, got '4'"),
    ({"history_retention": 0}, "outbox.E004",
     "OUTBOX['history_retention'] must be a positive number of seconds, got 0"),
    ({"dead_letter_retention": -1}, "outbox.E004",
     "OUTBOX['dead_letter_retention'] must be a positive number of seconds or None, got -1"),
    ({"history_interval": -1}, "outbox.E004", "OUTBOX['history_interval'] must be at least 0, got -1"),
    ({"dead_letter_topic": "no spaces"}, "outbox.E007", "OUTBOX['dead_letter_topic'] must be a Kafka topic name"),
    ({"mark_query_recods": 5}, "outbox.E002", "OUTBOX['mark_query_recods'] is not a known setting"),
])
def test_each_bad_setting_is_one_clear_check_error(outbox, code, text):
    with override_settings(OUTBOX=outbox):
        messages = checks.run_checks(tags=["outbox"])
    assert [m.id for m in messages] == [code], [m.msg for m in messages]
    assert messages[0].msg.startswith(text), messages[0].msg
    assert "OUTBOX OUTBOX" not in messages[0].msg


def test_a_bad_heartbeat_timeout_is_reported_once_not_through_the_limits_derived_from_it():
    with override_settings(OUTBOX={"heartbeat_timeout": "5s"}):
        messages = checks.run_checks(tags=["outbox"])
    assert [(m.id, m.msg) for m in messages] == [
        ("outbox.E003", "OUTBOX['heartbeat_timeout'] must be a number of seconds, got '5s'")]


def test_an_unknown_librdkafka_property_stops_harvest_at_its_system_check_not_with_a_traceback():
    result = subprocess.run([sys.executable, "manage.py", "harvest", "--print-config"], capture_output=True, text=True,
                            env={**os.environ, "OUTBOX_PRODUCER_KAFKA_CONFIG": "compresion.type=lz4"})
    assert result.returncode != 0
    assert "(outbox.E013) OUTBOX['producer_kafka_config'] is refused by librdkafka" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_retired_setting_is_accepted_with_a_warning_that_it_does_nothing():
    with override_settings(OUTBOX={"rescan_interval": 5}):
        messages = checks.run_checks(tags=["outbox"])
    assert [(m.id, m.level) for m in messages] == [("outbox.W004", checks.WARNING)]
    assert "rescan_interval" in messages[0].msg and "no longer does anything" in messages[0].msg


def test_a_long_heartbeat_timeout_keeps_the_derived_socket_timeout_within_librdkafka_s_range():
    # Found by test_fuzz_settings.py: heartbeat_timeout 151 made socket.timeout.ms 302,000 (librdkafka's
    # most is 300,000), refused as a setting nobody had set, in a message of two lines.
    assert outbox_errors(heartbeat_timeout=151) == []
    assert outbox_errors(heartbeat_timeout=1200) == []


def test_bootstrap_servers_come_from_outbox_else_the_environment_else_localhost_with_a_warning(monkeypatch):
    """One behaviour, everywhere: the harvester once ignored KAFKA_BOOTSTRAP_SERVERS when OUTBOX set no
    base_kafka_config, and tried localhost:9092 without a word."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "from-env:9092")
    with override_settings(OUTBOX={}):
        assert conf.harvest_config().base_kafka_config["bootstrap.servers"] == "from-env:9092"
        assert conf.kafka_config()["bootstrap.servers"] == "from-env:9092"
        assert not [m for m in checks.run_checks(tags=["outbox"]) if m.id == "outbox.W006"]
    with override_settings(OUTBOX={"base_kafka_config": {"bootstrap.servers": "from-outbox:9092"}}):
        assert conf.harvest_config().base_kafka_config["bootstrap.servers"] == "from-outbox:9092"
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS")
    with override_settings(OUTBOX={"base_kafka_config": {"sasl.password": "secret"}}):
        assert conf.harvest_config().base_kafka_config["bootstrap.servers"] == "localhost:9092"
        [warning] = [m for m in checks.run_checks(tags=["outbox"]) if m.id == "outbox.W006"]
    assert warning.msg == ("OUTBOX['base_kafka_config'] sets no bootstrap.servers and KAFKA_BOOTSTRAP_SERVERS is not "
                           "set either, so Kafka is looked for at localhost:9092: set one of them")
    from outbox.management.commands.outbox_audit import Command as Audit

    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "from-env:9092")
    with override_settings(OUTBOX={}):  # the audit once took HarvestConfig's own default, localhost:9092
        assert Audit._defaults().bootstrap_servers == "from-env:9092"


def test_outbox_is_read_once_and_again_when_the_settings_change():
    with override_settings(OUTBOX={"max_value_bytes": 10}):
        first = conf.current()
        assert conf.current() is first and conf.setting("max_value_bytes") == 10
        with override_settings(OUTBOX={"max_value_bytes": 20, "stuck_after": timedelta(minutes=1)}):
            assert conf.setting("max_value_bytes") == 20 and conf.setting("stuck_after") == 60.0
        assert conf.setting("max_value_bytes") == 10


def test_a_value_in_breach_of_its_rule_is_reported_and_its_default_used_meanwhile():
    with override_settings(OUTBOX={"stuck_after": -1, "max_header_bytes": "big"}):
        assert conf.setting("stuck_after") == 300.0 and conf.setting("max_header_bytes") == 65536
        assert sorted(m.id for m in checks.run_checks(tags=["outbox"])) == ["outbox.E003", "outbox.E003"]


@pytest.mark.parametrize("key", ["leader_topic", "leader_group", "name"])
def test_an_empty_leader_topic_group_or_name_is_refused_not_derived(key):
    """Only an absent one is derived, by manage.py harvest as by outbox-harvest (which always refused it)."""
    assert ("outbox.E007" if key == "leader_topic" else "outbox.E008") in outbox_errors(**{key: ""})


def test_a_heartbeat_timeout_whose_session_kafka_refuses_by_default_is_a_warning():
    """3 x heartbeat_timeout under the brokers' default group.min.session.timeout.ms (6 s): the leader consumer's
    JoinGroup is refused, and the harvester stops at start saying so (tests/integration/test_harvest.py)."""
    with override_settings(OUTBOX={"heartbeat_timeout": 1.5, "base_kafka_config": {"bootstrap.servers": "k:9092"}}):
        messages = checks.run_checks(tags=["outbox"])
    assert [(m.id, m.msg) for m in messages] == [(
        "outbox.W007", "OUTBOX['heartbeat_timeout'] 1.5s gives the leader group a session timeout of 4.5s (3 x "
                       "heartbeat_timeout), under the 6s Kafka's brokers accept by default (group.min.session.timeout"
                       ".ms): unless the brokers' minimum is lowered, the harvester stops at start with Kafka's "
                       "refusal")]
    with override_settings(OUTBOX={"heartbeat_timeout": 2, "base_kafka_config": {"bootstrap.servers": "k:9092"}}):
        assert checks.run_checks(tags=["outbox"]) == []


def test_a_database_that_is_not_a_string_is_one_error_and_what_reads_it_uses_the_default():
    from outbox import many

    with override_settings(OUTBOX={"database": ["default"]}):
        messages = checks.run_checks(tags=["outbox"])
        assert [(m.id, m.msg.split(" (")[0]) for m in messages] == [
            ("outbox.E011", "OUTBOX['database'] must name an entry of DATABASES, got ['default']")]
        assert conf.database_alias() == "default"
        assert many.database_aliases() == ["default"]  # the console's dashboard reads these


def test_a_database_that_is_not_an_alias_is_one_line_from_harvest_not_a_traceback():
    from django.core.management import CommandError, call_command

    with override_settings(OUTBOX={"database": ["default"]}), pytest.raises(CommandError) as raised:
        call_command("harvest", "--print-config", stdout=io.StringIO())
    assert str(raised.value).startswith("invalid configuration: database: must name an entry of DATABASES")
