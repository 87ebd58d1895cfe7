"""The stand-alone harvester's configuration (outbox/harvest/cli.py), as its users meet it: flags, a TOML file and
the environment; one line for each kind of bad input; secrets never printed; no Django."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from outbox.harvest import cli, schema
from outbox.harvest.config import LIMIT_NAMES, Limits, leader_name

ROOT = Path(__file__).resolve().parents[2]
ENV = {"DATABASE_URL": "postgresql://shop:s3cret-pw@db.example:5433/shop", "KAFKA_BOOTSTRAP_SERVERS": "k1:9092"}


def settings(*argv: str, environ: dict[str, str] | None = None) -> cli.Settings:
    args = cli.parser().parse_args(["check", *argv])
    return cli.build(args, ENV if environ is None else environ)


def run_main(capsys, *argv: str, environ: dict[str, str] | None = None) -> tuple[int, str, str]:
    code = cli.main(list(argv), ENV if environ is None else environ)
    out, err = capsys.readouterr()
    return code, out, err


def toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "harvest.toml"
    path.write_text(text)
    return str(path)


def test_flags_win_over_the_file_and_the_file_over_the_environment(tmp_path):
    path = toml(tmp_path, 'dsn = "postgresql://file@filehost/filedb"\ntable = "app.outbox"\nheartbeat_timeout = 3\n'
                          'shards = 2\n[base_kafka_config]\n"bootstrap.servers" = "filekafka:9092"\n'
                          '[producer_kafka_config]\n"compression.type" = "lz4"\n')
    found = settings("--config", path, "--shards", "4", "--queue-timeout", "12")
    config = found.config
    assert found.problems == []
    assert (config.dsn, config.table, config.shards) == ("postgresql://file@filehost/filedb", "app.outbox", 4)
    assert config.base_kafka_config["bootstrap.servers"] == "filekafka:9092"
    assert config.producer_kafka_config == {"compression.type": "lz4"}
    assert (config.limits.heartbeat_timeout, config.limits.queue_timeout) == (3, 12)
    assert config.limits.delivery_timeout == 4.5, "derived from the file's heartbeat_timeout"
    assert found.given_limits == {"heartbeat_timeout", "queue_timeout"}
    from_env = settings().config
    assert from_env.dsn == ENV["DATABASE_URL"] and from_env.base_kafka_config["bootstrap.servers"] == "k1:9092"


def test_the_leader_group_is_the_one_manage_py_harvest_derives():
    """A stand-alone replica and a Django one on the same database and table are replicas of one group."""
    from outbox import conf

    derived = settings(environ={"DATABASE_URL": conf.dsn_for("default")}).config
    assert derived.leader_group == derived.leader_topic == conf.default_leader_name("default", "outbox")
    other = settings("--table", "other", environ={"DATABASE_URL": conf.dsn_for("default")}).config
    assert other.leader_group == conf.default_leader_name("default", "other") != derived.leader_group


def test_a_search_path_gives_an_unqualified_table_a_group_of_its_own(monkeypatch):
    """Two schemas' `outbox` tables, each reached through its connection's search_path, are two outboxes: a group
    each (one shared group would leave one of them unharvested), the same for Django and stand-alone replicas. A
    search_path that starts with public, and a qualified table, leave the name as it was."""
    from django.db import connections

    from outbox import conf

    plain, qualified = conf.default_leader_name("default", "outbox"), conf.default_leader_name("default", "gh.outbox")
    monkeypatch.setitem(connections["default"].settings_dict, "OPTIONS", {"options": "-c search_path=billing"})
    billing = conf.default_leader_name("default", "outbox")
    assert billing != plain and ".billing.outbox." in billing
    assert billing == conf.default_leader_name("default", "billing.outbox"), "the same table, the same group"
    standalone = settings(environ={"DATABASE_URL": conf.dsn_for("default")}).config
    assert standalone.leader_group == standalone.leader_topic == billing
    assert conf.default_leader_name("default", "gh.outbox") == qualified
    monkeypatch.setitem(connections["default"].settings_dict, "OPTIONS", {"options": "-c search_path=public,billing"})
    assert conf.default_leader_name("default", "outbox") == plain


@pytest.mark.parametrize(("options", "schema"), [
    ("-c search_path=billing", "billing"), ("-csearch_path=billing,public", "billing"),
    ("--search-path=Billing", "billing"), ("-c SEARCH_PATH=\\ billing", "billing"),
    ('-c search_path="Billing"', "Billing"),
    ("-c statement_timeout=5s -c search_path=billing", "billing"), ("-c search_path=$user,public", None),
    ("-c statement_timeout=5s", None), (None, None),
])
def test_the_first_schema_of_a_search_path_is_read_as_postgres_reads_it(options, schema):
    from outbox.harvest.config import first_schema

    assert first_schema(options) == schema


@pytest.mark.parametrize(("text", "expected"), [
    ("heartbeat_timout = 3\n", "invalid configuration: heartbeat_timout: is not a known setting (did you mean "
                               "'heartbeat_timeout'?)"),
    ("heartbeat_timeout = -1\n", "invalid configuration: heartbeat_timeout: must be at least 0.001, got -1"),
    ("shards = 0\n", "invalid configuration: shards: must be a whole number from 1 to 256, got 0"),
    ("table = 'no such; table'\n", "invalid configuration: table: must be an SQL identifier"),
    ("heartbeat_timeout = [\n", "--config: "),
])
def test_a_bad_file_is_one_line_naming_the_key(capsys, tmp_path, text, expected):
    code, out, err = run_main(capsys, "--config", toml(tmp_path, text))
    assert code == 1 and out == ""
    assert err.startswith(f"outbox-harvest: {expected}"), err
    assert err.count("\n") == 1, err


def test_a_missing_file_and_a_bad_flag_are_one_line(capsys, tmp_path):
    code, _, err = run_main(capsys, "--config", str(tmp_path / "missing.toml"))
    assert (code, err.count("\n")) == (1, 1) and "cannot read" in err and "missing.toml" in err
    with pytest.raises(SystemExit) as exited:
        cli.main(["--shards", "many"], ENV)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and "--shards: invalid int value: 'many'" in err


def test_a_mistyped_command_and_a_bad_gone_after_are_one_line_naming_them(capsys):
    code, out, err = run_main(capsys, "chek")
    assert (code, out) == (2, "")
    assert err == "outbox-harvest: unknown command 'chek' (choose from run, check, schema, health, reshard; see " \
                  "--help)\n"
    for value in ("-3", "0", "nan", "soon"):
        with pytest.raises(SystemExit) as exited:
            cli.main(["health", "--gone-after", value], ENV)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.count("\n") == 1, err
        assert f"--gone-after: must be a positive number of seconds, got {value!r}" in err


def test_reshard_takes_one_outbox_whatever_the_flags(capsys, tmp_path):
    path = toml(tmp_path, "[outboxes.shop]\n[outboxes.billing]\nshards = 2\n")
    for flags in ((), ("--table", "other"), ("--leader-topic", "t")):
        code, out, err = run_main(capsys, "reshard", "--shards", "2", "--config", path, *flags)
        assert (code, out) == (1, "")
        assert err == "outbox-harvest: reshard: one outbox at a time: give it a --config file without [outboxes], " \
                      "with that outbox's dsn, table and leader_topic\n"


def test_no_database_says_where_to_set_one(capsys):
    code, _, err = run_main(capsys, environ={})
    assert code == 1
    assert err == "outbox-harvest: invalid configuration: dsn: no database: set DATABASE_URL (or dsn in the " \
                  "--config file)\n"


def test_check_reports_each_problem_once_with_its_code(capsys, tmp_path):
    """A problem is reported on the limit the user set, not again on the limits derived from it."""
    code, out, _ = run_main(capsys, "check", "--heartbeat-timeout", "-1", "--queue-timeout", "0")
    assert code == 1
    assert out.splitlines() == ["outbox.E004 heartbeat_timeout: must be at least 0.001, got -1.0",
                                "outbox.E004 queue_timeout: must be at least 0.001, got 0.0"]
    code, out, _ = run_main(capsys, "check", "--config", toml(tmp_path, '[producer_kafka_config]\n"acks" = 1\n'))
    assert code == 1 and out.startswith("outbox.E014 producer_kafka_config: acks must stay 'all'")
    code, out, _ = run_main(capsys, "check", "--config", toml(tmp_path, '[base_kafka_config]\n"no.such" = 1\n'))
    assert code == 1 and out.startswith("outbox.E013 base_kafka_config: is refused by librdkafka")
    assert run_main(capsys, "check") == (0, "no problems found\n", "")


def test_kafka_at_localhost_is_a_warning_naming_where_to_set_it(capsys):
    code, out, _ = run_main(capsys, "check", environ={"DATABASE_URL": ENV["DATABASE_URL"]})
    assert code == 0
    assert out.startswith("outbox.W006 base_kafka_config: sets no bootstrap.servers and KAFKA_BOOTSTRAP_SERVERS is "
                          "not set either, so Kafka is looked for at localhost:9092")


def test_secrets_are_never_printed(capsys, tmp_path):
    path = toml(tmp_path, '[base_kafka_config]\n"sasl.password" = "kafka-s3cret-pw"\n"sasl.mechanism" = "PLAIN"\n'
                          '"security.protocol" = "SASL_PLAINTEXT"\n"sasl.username" = "app"\n')
    code, out, err = run_main(capsys, "--config", path, "--print-config")
    assert code == 0
    printed = json.loads(out)
    assert printed["base_kafka_config"]["sasl.password"] == "***" and "s3cret-pw" not in printed["dsn"]
    code, _, err = run_main(capsys, "--config", path, "--leader-group", "s3cret-pw\n")
    assert code == 1 and "s3cret-pw" not in err and "leader_group" in err


def test_the_limit_flags_are_the_limits():
    flags = {action.dest for action in cli.parser()._subparsers._group_actions[0].choices["run"]._actions}
    assert set(LIMIT_NAMES) == {spec.name for spec in dataclasses.fields(Limits)} <= flags


def test_the_derived_leader_name_stays_what_running_replicas_use():
    """Replicas of an older version and this one must land in one group: the formula does not change."""
    digest = hashlib.sha1(b"db.example:5433/shop/app.outbox").hexdigest()[:8]
    assert leader_name("db.example", "5433", "shop", "app.outbox") == f"outbox-leader.shop.app.outbox.{digest}"
    assert settings("--table", "app.outbox").config.leader_group == f"outbox-leader.shop.app.outbox.{digest}"


@pytest.mark.parametrize(("environ", "text", "expected"), [
    ({"DATABASE_URL": "postgresql://u:s3cr%zzetpw@db/shop"}, "", "dsn: is not a libpq connection string or URL"),
    ({}, "dsn = 5\n", "dsn: must be a libpq connection string or URL, got 5"),
])
def test_a_database_that_cannot_be_named_is_one_line_quoting_no_password(capsys, tmp_path, environ, text, expected):
    path = toml(tmp_path, text)
    for command in (["check", "--config", path], ["--config", path], ["schema", "--apply", "--config", path],
                    ["health", "--config", path]):
        code, out, err = run_main(capsys, *command, environ=environ)
        assert code == 1 and "s3cr" not in out + err, (command, out, err)
        assert expected.split(":")[1].strip()[:20] in out + err, (command, out, err)
        assert (out + err).count("\n") == 1, (command, out, err)


def test_a_file_that_is_not_utf8_is_one_line(capsys, tmp_path):
    path = tmp_path / "harvest.toml"
    path.write_bytes(b"table = \"caf\xe9\"\n")
    code, _, err = run_main(capsys, "--config", str(path))
    assert code == 1 and err.startswith("outbox-harvest: --config: ") and "not valid TOML (UTF-8)" in err
    assert err.count("\n") == 1


def test_an_empty_name_is_refused_not_replaced(capsys):
    code, out, _ = run_main(capsys, "check", "--name", "")
    assert code == 1 and out.startswith("outbox.E008 name: ")
    code, out, _ = run_main(capsys, "check", "--leader-topic", "")
    assert code == 1 and out.startswith("outbox.E007 leader_topic: ")


def test_check_masks_secrets_in_what_it_reports(capsys, tmp_path):
    path = toml(tmp_path, '[base_kafka_config]\n"sasl.password" = "kafka-s3cret-pw"\n')
    code, out, _ = run_main(capsys, "check", "--config", path, "--leader-group", "kafka-s3cret-pw\n")
    assert code == 1 and "E008 leader_group" in out and "s3cret" not in out


def test_the_schema_has_one_section_per_migration():
    migrations = sorted(p.stem for p in (ROOT / "outbox" / "migrations").glob("0*.py"))
    assert [s.name for s in schema.sections()] == migrations
    assert schema.after("0008")[0].name == "0009_shard_terms" and schema.after(migrations[-1]) == []
    with pytest.raises(ValueError, match="no migration '0042'"):
        schema.after("0042")


def test_it_runs_without_django():
    """Django made unimportable: the stand-alone harvester's check and schema still work."""
    blocked = "import sys; sys.modules['django'] = None; from outbox.harvest.cli import main; sys.exit(main())"
    env = {"PATH": "/usr/bin:/bin", **ENV}
    checked = subprocess.run([sys.executable, "-c", blocked, "check"], env=env, capture_output=True, text=True,
                             cwd=ROOT, timeout=60)
    assert (checked.returncode, checked.stdout, checked.stderr) == (0, "no problems found\n", "")
    printed = subprocess.run([sys.executable, "-c", blocked, "schema"], env=env, capture_output=True, text=True,
                             cwd=ROOT, timeout=60)
    assert printed.returncode == 0 and "CREATE TRIGGER outbox_notify" in printed.stdout
    as_module = ("import runpy, sys; sys.modules['django'] = None; sys.argv[1:] = ['--help']; "
                 "runpy.run_module('outbox.harvest', run_name='__main__')")
    module = subprocess.run([sys.executable, "-c", as_module], env=env, capture_output=True, text=True, cwd=ROOT,
                            timeout=60)
    assert module.returncode == 0 and "usage: outbox-harvest" in module.stdout


# ------------------------------------------------------------------------------------ several outboxes in one process

OUTBOXES = ('[outboxes.shop]\n'
            '[outboxes.billing]\ndsn = "postgresql://billing:b1lling-pw@billing.example/billing"\n'
            'table = "ledger.outbox"\nshards = 2\n')


def test_the_files_outboxes_are_discovered_as_manage_py_harvest_discovers_them(tmp_path):
    """Each entry's engine: its own database (`dsn`, else the file's), a leader group derived from it as
    for one outbox, the process's name and its label, the rare idle poll of a shared LISTEN session."""
    found = settings("--config", toml(tmp_path, OUTBOXES), "--name", "r")
    assert found.problems == [] and sorted(found.entries) == ["billing", "shop"]
    outboxes = found.discover()
    shop, billing = outboxes["shop"], outboxes["billing"]
    assert (shop.dsn, shop.table, shop.shards, shop.name) == (ENV["DATABASE_URL"], "outbox", 1, "r/shop")
    assert (billing.table, billing.shards, billing.name) == ("ledger.outbox", 2, "r/billing")
    assert billing.dsn == "postgresql://billing:b1lling-pw@billing.example/billing"
    assert shop.leader_group == shop.leader_topic == leader_name("db.example", "5433", "shop", "outbox")
    assert billing.leader_group == leader_name("billing.example", None, "billing", "ledger.outbox")
    assert shop.limits.idle_poll_interval == 60.0 and found.discover_interval == 30.0
    assert all(not config.validate() for config in outboxes.values())
    given = settings("--config", toml(tmp_path, "discover_interval = 5\n" + OUTBOXES), "--idle-poll-interval", "2")
    assert given.problems == [] and given.discover_interval == 5
    assert given.discover()["shop"].limits.idle_poll_interval == 2, "a given idle poll is kept"


def test_outbox_picks_entries_and_tenant_schemas_adds_one(tmp_path):
    path = toml(tmp_path, OUTBOXES)
    assert list(settings("--config", path, "--outbox", "billing").entries) == ["billing"]
    assert settings("--tenant-schemas", "--exclude-schema", "public").entries == {
        "tenants": {"tenant_schemas": True, "exclude_schemas": ["public"]}}
    assert settings().entries is None, "no outboxes listed: one outbox, as before"


@pytest.mark.parametrize(("argv", "text", "expected"), [
    (["--outbox", "nope"], OUTBOXES, "--outbox: no outbox named 'nope' in the file's [outboxes] (there are: billing, "
                                     "shop)"),
    (["--exclude-schema", "public"], "", "--exclude-schema: applies only with --tenant-schemas"),
    (["--tenant-schemas", "--leader-topic", "t"], "", "--leader-topic: cannot be given with several outboxes"),
    (["--table", "other"], OUTBOXES, "--table: with the file's [outboxes], each outbox names its own"),
])
def test_flags_that_cannot_go_together_are_one_line(capsys, tmp_path, argv, text, expected):
    code, out, err = run_main(capsys, "--config", toml(tmp_path, text), *argv)
    assert code == 1 and out == "" and err.startswith(f"outbox-harvest: {expected}"), err
    assert err.count("\n") == 1


@pytest.mark.parametrize(("text", "expected"), [
    ('[outboxes.shop]\ntabel = "x"\n', "outbox.E018 outboxes.shop.tabel: is not a key of an outbox"),
    ('[outboxes.shop]\nshards = 0\n', "outbox.E018 outboxes.shop.shards: must be a whole number"),
    ('[outboxes.shop]\ndsn = 5\n', "outbox.E018 outboxes.shop.dsn: must be a libpq connection string or URL"),
    ('[outboxes.t]\ntenant_schemas = true\ntable = "s.outbox"\n', "outbox.E018 outboxes.t.table: must be an "
                                                                   "unqualified SQL identifier"),
    ('[outboxes."a.b"]\n', "outbox.E018 outboxes.a.b: must not contain '.' or '/'"),
    ("outboxes = 3\n", "outbox.E018 outboxes: must be a non-empty table"),
    ("discover_interval = 0\n", "outbox.E003 discover_interval: must be a positive number of seconds"),
])
def test_a_bad_outboxes_entry_is_reported_once_with_its_code(capsys, tmp_path, text, expected):
    code, out, _ = run_main(capsys, "check", "--config", toml(tmp_path, text))
    assert code == 1 and out.startswith(expected), out
    assert out.count("\n") == 1, out


def test_each_outboxs_configuration_is_printed_with_its_secrets_masked(capsys, tmp_path):
    password = f"b1lling-pw-{uuid.uuid4().hex}"  # remembered by no earlier test
    path = toml(tmp_path, OUTBOXES.replace("b1lling-pw", password))
    code, _, err = run_main(capsys, "--config", path, "--outbox", password)
    assert code == 1 and password not in err and "no outbox named" in err, "masked, even in the first line quoting it"
    code, out, err = run_main(capsys, "--config", path, "--print-config")
    assert code == 0, err
    printed = json.loads(out)
    assert sorted(printed) == ["billing", "shop"] and printed["billing"]["shards"] == 2
    assert password not in out and "s3cret-pw" not in out


def test_print_config_of_several_outboxes_with_a_bad_limit_prints_each_then_names_each_ones_problem(capsys, tmp_path):
    """As `manage.py harvest --print-config`: each outbox as discovered, then its problem naming its label (the base
    configuration's, which each outbox's repeats, not said again)."""
    code, out, err = run_main(capsys, "--config", toml(tmp_path, OUTBOXES), "--heartbeat-timeout", "-1",
                              "--print-config")
    assert code == 1 and sorted(json.loads(out)) == ["billing", "shop"]
    assert err == ("outbox-harvest: invalid configuration: billing: heartbeat_timeout: must be at least 0.001, got "
                   "-1.0; shop: heartbeat_timeout: must be at least 0.001, got -1.0\n")
    code, out, err = run_main(capsys, "--config", toml(tmp_path, OUTBOXES + "[outboxes.x]\ntabel = 1\n"),
                              "--print-config")
    assert code == 1 and out == "" and "outboxes.x.tabel: is not a key of an outbox" in err, "nothing to discover"


def test_print_config_of_several_outboxes_never_passes_a_problem_over(capsys, tmp_path):
    """A base key that an entry overrides is still said; nothing is discovered (no database is asked) while
    something besides the engines' configuration is wrong, and each problem is said once."""
    code, out, err = run_main(capsys, "--config", toml(tmp_path, 'table = "1bad"\n[outboxes.a]\ntable = "x"\n'),
                              "--print-config")
    assert code == 1 and list(json.loads(out)) == ["a"] and "table: must be an SQL identifier" in err
    code, out, err = run_main(capsys, "--config", toml(tmp_path, OUTBOXES), "--print-config",
                              environ={"KAFKA_BOOTSTRAP_SERVERS": "k1:9092"})
    assert (code, out) == (1, "") and err.count("dsn:") == 1 and "no database" in err, err
    code, out, _ = run_main(capsys, "check", "--tenant-schemas", "--table", "1bad")
    assert code == 1 and out.startswith("outbox.E006 table: ") and out.count("\n") == 1, out


def test_the_files_the_docs_show_pass_check(tmp_path):
    """Every TOML file docs/standalone.md shows is one `outbox-harvest check` accepts, as written."""
    blocks = re.findall(r"```toml\n(.*?)```", (ROOT / "docs" / "standalone.md").read_text(), re.DOTALL)
    assert len(blocks) >= 2
    for block in blocks:
        found = settings("--config", toml(tmp_path, block))
        assert found.problems == [], (block, found.problems)
    assert sorted(found.entries) == ["billing", "shop", "tenants"]
