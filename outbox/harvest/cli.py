"""`outbox-harvest` (and `python -m outbox.harvest`): the harvester without a Django project, for applications in
any language that write goharvest's outbox table.

    DATABASE_URL=postgresql://app@db/shop KAFKA_BOOTSTRAP_SERVERS=kafka:9092 outbox-harvest
    outbox-harvest --config harvest.toml --shards 4 --metrics-port 9108
    outbox-harvest check --config harvest.toml      # the settings' problems, with manage.py check's codes
    outbox-harvest --tenant-schemas --exclude-schema public   # the table of every schema, an engine each
    outbox-harvest schema [--apply] [--since NAME]  # the DDL of the migrations (outbox/harvest/schema.sql)
    outbox-harvest reshard --shards 6 --config harvest.toml   # with the group's replicas stopped

The settings are OUTBOX's engine keys (harvest/config.py: SETTING_KEYS and the limits), read from a TOML file
(its tables `base_kafka_config` and `producer_kafka_config` are librdkafka's properties), then the environment
(DATABASE_URL for `dsn`, KAFKA_BOOTSTRAP_SERVERS when the file sets no bootstrap.servers), then flags. A replica
started here and one started by `manage.py harvest` on the same database and table derive the same leader group.
Several outboxes in one process (the file's `[outboxes.NAME]` tables, each naming its database by `dsn`, or
`--tenant-schemas`) are discovered as `manage.py harvest` discovers OUTBOX["outboxes"] (harvest/discovery.py).
Nothing here imports Django: a test runs it with Django made unimportable.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from outbox import logs
from outbox.harvest import discovery, horizon, replicas, running, schema
from outbox.harvest.config import (
    LIMIT_NAMES,
    SETTING_KEYS,
    TABLE_PATTERN,
    HarvestConfig,
    derived_leader_name,
    from_values,
)
from outbox.harvest.kafka import client_config_problems
from outbox.harvest.reshard import ReshardRefused, reshard
from outbox.harvest.store import StoreError, table_identifier
from outbox.kafka.keys import NO_BOOTSTRAP, key, positive_seconds
from outbox.kafka.problems import Problem, unknown_keys
from outbox.kafka.redaction import dsn_problem, remember_secrets, scrub, secret_values
from outbox.metrics_endpoint import add_metrics_flags
from outbox.reasons import first_line

PROG = "outbox-harvest"
COMMANDS = ("run", "check", "schema", "health", "reshard")
#: What a TOML file may set: the engine's keys, its limits, the database, and several outboxes.
FILE_KEYS = frozenset({"dsn", *SETTING_KEYS, *LIMIT_NAMES, "outboxes", "discover_interval"})
#: Flags that set an engine key of the same name.
FLAG_KEYS = (*running.SETTING_FLAGS, *LIMIT_NAMES)
#: Where the file lists several outboxes, as the flags' help and errors name it.
OUTBOXES = "the file's [outboxes]"


@dataclass(frozen=True)
class FileEntry(discovery.Entry):
    """What an `[outboxes.NAME]` table of the file may set: its database by `dsn`, and discovery.Entry's keys."""

    dsn: str | None = key(None, "its database, a libpq connection string or URL", shown="the file's `dsn`, else "
                                                                                      "`DATABASE_URL`")


@dataclass(frozen=True)
class Settings(running.Plan):
    """The plan as built from a file, the environment and flags, with what `check` reports besides its problems."""

    #: Where bootstrap.servers came from (None: nowhere, W006).
    bootstrap_source: str | None = None
    secrets: set[str] = field(default_factory=set)
    #: Several outboxes' entries (the file's, or --tenant-schemas'), None for one outbox.
    entries: dict[str, dict[str, Any]] | None = None

    def warnings(self) -> list[Problem]:
        return self.config.warnings() + ([NO_BOOTSTRAP] if self.bootstrap_source is None else [])


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a bad flag said in one line (argparse prints its usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def parser() -> argparse.ArgumentParser:
    top = OneLineParser(prog=PROG, description="Publish a goharvest outbox table to Kafka, with leader "
                                  "election among replicas, until SIGTERM or SIGINT; no Django project needed.")
    commands = top.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}", parser_class=OneLineParser)
    settings = argparse.ArgumentParser(add_help=False)
    settings.add_argument("--config", metavar="FILE.toml", type=Path,
                          help="a TOML file of settings (OUTBOX's engine keys); flags win over it")
    running.add_setting_flags(settings)
    running.add_outbox_flags(settings, OUTBOXES, "the file's table")
    settings.add_argument("-v", "--verbosity", type=int, choices=(0, 1, 2, 3), default=1,
                          help="0 warnings, 1 info (default), 2 and 3 debug")
    running.add_limit_flags(settings)
    run = commands.add_parser("run", parents=[settings], help="harvest until SIGTERM or SIGINT (the default)")
    add_metrics_flags(run)
    run.add_argument("--print-config", action="store_true",
                     help="print the effective configuration (secrets redacted) as JSON and exit")
    commands.add_parser("check", parents=[settings], help="report the settings' problems (manage.py check's codes) "
                                                          "and exit 1 if there is an error")
    ddl = commands.add_parser("schema", help="print the DDL of the tables and trigger the harvester uses (the same as "
                                             "the Django app's migrations)")
    ddl.add_argument("--apply", action="store_true", help="run it on DATABASE_URL's database (or --config's dsn)")
    ddl.add_argument("--since", metavar="MIGRATION", help="only the migrations after this one (to upgrade a schema "
                                                          "made by an earlier version), e.g. 0008_status_shards")
    ddl.add_argument("--config", metavar="FILE.toml", type=Path, help="a TOML file whose dsn names the database")
    shard = commands.add_parser("reshard", help="change the number of shards of the table's leader group, its "
                                                "replicas stopped first (as manage.py outbox_reshard)")
    shard.add_argument("--shards", type=int, required=True, metavar="M", help="the new number of shards")
    shard.add_argument("--config", metavar="FILE.toml", type=Path, help="a TOML file of settings (its dsn, table, "
                                                                        "leader_topic, base_kafka_config)")
    shard.add_argument("--table", help="outbox table, optionally schema.table (default: the file's, else outbox)")
    shard.add_argument("--leader-topic", help="the group's leader topic (default: as the harvester derives it)")
    probe = commands.add_parser("health", help="check replicas through their status rows: exit 0 if healthy, 1 with "
                                               "the reason if not (a liveness or readiness probe)")
    probe.add_argument("--config", metavar="FILE.toml", type=Path,
                       help="a TOML file whose dsn (and status_table) name the database; its [outboxes]' "
                            "dsn name other databases whose status rows are read too")
    probe.add_argument("--name", help="check the replica with this --name")
    probe.add_argument("--host", help="check replicas on this host (default: this host, unless --name or --any)")
    probe.add_argument("--any", action="store_true", help="check all replicas, wherever they run")
    probe.add_argument("--require-leader", action="store_true",
                       help="also fail unless some live replica leads (for alerting, not liveness)")
    probe.add_argument("--gone-after", type=_positive_seconds, default=replicas.GONE_AFTER, metavar="SECONDS",
                       help="a replica whose status row is older than this is gone")
    return top


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def read_file(path: Path | None) -> tuple[dict[str, Any], list[Problem]]:
    """The TOML file's settings and the unknown keys among them (E002, with a "did you mean"); RunFailure (one
    line) when it cannot be read or parsed."""
    if path is None:
        return {}, []
    try:
        with path.open("rb") as file:
            values = tomllib.load(file)
    except OSError as error:
        raise running.RunFailure(f"--config: cannot read {path}: {error.strerror or error}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise running.RunFailure(f"--config: {path} is not valid TOML (UTF-8): {first_line(error)}") from None
    return values, unknown_keys(values, FILE_KEYS)


NO_DATABASE = "no database: set DATABASE_URL (or dsn in the --config file)"


def database_problem(dsn: Any) -> Problem | None:
    """Why `dsn` (the file's, else DATABASE_URL) names no database, in words that quote none of it; else None."""
    if not isinstance(dsn, str):
        return Problem("E005", "dsn", f"must be a libpq connection string or URL, got {dsn!r}")
    if not dsn:
        return Problem("E005", "dsn", NO_DATABASE)
    problem = dsn_problem(dsn)
    return None if problem is None else Problem("E005", "dsn", problem)


def dsn_of(values: Mapping[str, Any], environ: Mapping[str, str]) -> str:
    """The file's dsn, else DATABASE_URL (its secrets remembered for masking); RunFailure when it names no
    database."""
    dsn = values.get("dsn") or environ.get("DATABASE_URL", "")
    if (problem := database_problem(dsn)) is not None:
        raise running.RunFailure(str(problem))
    remember_secrets(dsn)
    return dsn


def build(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    """The configuration from the file, the environment and the flags (flags win, then the file)."""
    values, found = read_file(getattr(args, "config", None))
    values = {key: value for key, value in values.items() if key in FILE_KEYS}
    outboxes, interval = values.pop("outboxes", None), values.pop("discover_interval", discovery.DISCOVER_INTERVAL)
    for name in FLAG_KEYS:
        if getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    dsn = values.pop("dsn", None) or environ.get("DATABASE_URL", "")
    dsn_problems = [problem] if (problem := database_problem(dsn)) is not None else []
    dsn = dsn if isinstance(dsn, str) else ""
    remember_secrets(dsn, values, outboxes)
    config, given, source = from_values(values, dsn=dsn, derived_leader=derived_leader_name(dsn, values.get("table")),
                                        environ=environ, given_by="base_kafka_config")
    problems = found + dsn_problems + [p for p in config.validate(given_limits=given) if p.field != "dsn"]
    if (problem := positive_seconds(interval)) is not None:
        problems.append(Problem("E003", "discover_interval", problem))
    problems += outboxes_problems(outboxes, values.get("table", HarvestConfig.table))
    entries = discover = None
    chosen, tenant_schemas = getattr(args, "outbox", None), getattr(args, "tenant_schemas", False)
    several = bool(outboxes or chosen or tenant_schemas)
    if problem := running.outbox_flags_problem(vars(args), OUTBOXES, several=several):
        raise running.RunFailure(problem)
    if several and running.discoverable(config, given, problems, getattr(args, "print_config", False)):
        excluded = getattr(args, "exclude_schema", None)
        tenants = {"exclude_schemas": list(excluded)} if excluded else {}
        try:
            entries = discovery.select(outboxes or {}, chosen, where=OUTBOXES,
                                       tenants=tenants if tenant_schemas else None)
        except ValueError as error:
            raise running.RunFailure(str(error)) from None
        if entries_problems := outboxes_problems(entries, values.get("table", HarvestConfig.table)):
            problems = problems or entries_problems  # --tenant-schemas' entry, said once the rest is right
        else:
            discover = discovery.discoverer(config, entries, given, _locate(config.dsn))
    if not problems:
        problems = client_config_problems(config)
    return Settings(config, given, problems, several, discover, interval, source, secret_values(dsn, values, outboxes),
                    entries)


def _locate(default_dsn: str) -> discovery.Locate:
    """An entry's database by its `dsn`, else the file's: its DSN and derived leader names."""
    def locate(entry: Mapping[str, Any]) -> tuple[str, Callable[[str], str]]:
        dsn = entry.get("dsn") or default_dsn
        return dsn, lambda table: derived_leader_name(dsn, table)

    return locate


def outboxes_problems(outboxes: Any, table: Any) -> list[Problem]:
    """What is wrong with the file's [outboxes] (None: not there), each naming the entry and its key (E018)."""
    def database(entry: Mapping[str, Any]) -> tuple[str, str] | None:
        problem = database_problem(entry["dsn"]) if "dsn" in entry else None
        return None if problem is None else ("dsn", problem.message)

    return discovery.outboxes_problems(outboxes, FileEntry, table, database, kind="table")


#: Parked records are counted exactly up to this many (a bounded scan, as the console counts them).
PARKED_COUNT_LIMIT = 10_000


def parked_count(conn: psycopg.Connection, table: str | None) -> int | None:
    """Rows in the dead-letter table, at most PARKED_COUNT_LIMIT + 1; None when there is no such table
    (parking is off: no figure, and nothing to warn about)."""
    if table is None or conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()[0] is None:
        return None
    return conn.execute(sql.SQL("SELECT count(*) FROM (SELECT 1 FROM {} LIMIT {}) AS parked").format(
        table_identifier(table), sql.Literal(PARKED_COUNT_LIMIT + 1))).fetchone()[0]


def database_readers(config: HarvestConfig) -> dict[str, Callable[[], Any]]:
    """The metrics' readers of what the harvester does not know (parked records, the oldest row's age, who holds
    the database's horizon back), by psycopg: a short connection per scrape, as Django's readers make."""
    log = logging.getLogger("outbox.metrics")

    def read(what: str, query: Callable[[psycopg.Connection], Any]) -> Any:
        try:
            with psycopg.connect(config.dsn, connect_timeout=5, autocommit=True) as conn:
                return query(conn)
        except psycopg.Error as error:
            log.warning("Could not read %s: %s", what, first_line(error))
            return None

    def oldest_age(conn: psycopg.Connection) -> float:
        age = conn.execute(sql.SQL("SELECT coalesce((SELECT extract(epoch FROM statement_timestamp() - create_time) "
                                   "FROM {} ORDER BY id LIMIT 1), 0)").format(table_identifier(config.table))
                           ).fetchone()[0]
        return max(0.0, float(age))

    return {"parked": lambda: read("the parked records", lambda conn: parked_count(conn, config.dead_letter_table)),
            "oldest_age": lambda: read("the oldest outbox row", oldest_age),
            "horizon": lambda: read("the database's horizon", lambda conn: horizon.read_with(conn.cursor(),
                                                                                              config.table))}


def run(args: argparse.Namespace, settings: Settings) -> None:
    running.harvest(settings, print_config=args.print_config, out=print, verbosity=args.verbosity,
                    metrics_port=args.metrics_port, metrics_address=args.metrics_address,
                    readers=lambda: database_readers(settings.config))


def check(settings: Settings) -> int:
    """manage.py check's report: one line a problem, with its code; 1 when there is an error."""
    reported = settings.problems or settings.warnings()
    for problem in reported:
        print(scrub(f"outbox.{problem.code} {problem}", settings.secrets))
    if not reported:
        print("no problems found")
    return 1 if settings.problems else 0


def reshard_command(args: argparse.Namespace, settings: Settings) -> int:
    """manage.py outbox_reshard's change, on the file's (or the environment's) database and leader topic."""
    if settings.problems:
        raise running.RunFailure("invalid configuration: " + "; ".join(map(str, settings.problems)))
    logs.configure_logging(1)  # what it says meanwhile (an index another replica builds, a slow broker)
    try:
        done = reshard(settings.config, args.shards)
    except ReshardRefused as error:
        raise running.RunFailure(str(error)) from None
    print(f"{done} Start the replicas with --shards {args.shards} (or shards = {args.shards} in the file).")
    return 0


def schema_command(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    if not args.apply:
        try:
            print(schema.ddl(args.since), end="")
        except ValueError as error:
            raise running.RunFailure(str(error)) from None
        return
    values, _unknown = read_file(args.config)
    dsn = dsn_of(values, environ)
    try:
        ran = schema.apply(dsn, args.since)
    except (StoreError, ValueError) as error:
        raise running.RunFailure(str(error)) from None
    print(f"applied {len(ran)} migration(s): {', '.join(ran)}" if ran else "nothing to apply")


def health_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """manage.py harvest_health's verdict, on status rows read by psycopg: one line, exit status 0 or 1."""
    values, _unknown = read_file(args.config)
    dsn = dsn_of(values, environ)
    status_table = values.get("status_table", HarvestConfig.status_table)
    if not isinstance(status_table, str) or not TABLE_PATTERN.fullmatch(status_table):
        raise running.RunFailure(f"status_table: must be an SQL identifier, got {status_table!r}")
    try:
        with psycopg.connect(dsn, connect_timeout=10, autocommit=True) as conn:
            rows, now = replicas.read(conn, status_table)
            parked = parked_count(conn, HarvestConfig.dead_letter_table)
    except psycopg.Error as error:
        print(scrub(f"unhealthy: cannot read harvester status: {first_line(error)}"))
        return 1
    # Another database that cannot be read is said, and judges nothing (as manage.py harvest_health): a liveness
    # probe must not restart a replica whose outboxes are all in a database it can read.
    others, unread = other_status_rows(values.get("outboxes"), dsn, status_table)
    counts = "; ".join([*([] if parked is None else [f"{parked} parked"]), *unread])
    healthy, why = replicas.health(replicas.Replicas.sort([*rows, *others], now, args.gone_after), now,
                                   name=args.name, host=args.host, any=args.any, require_leader=args.require_leader,
                                   gone_after=args.gone_after, counts=counts)
    print(scrub(f"{'ok' if healthy else 'unhealthy'}: {why}"))
    return 0 if healthy else 1


def other_status_rows(outboxes: Any, dsn: str, status_table: str) -> tuple[list[Any], list[str]]:
    """The status rows in the other databases the file's [outboxes] name by `dsn` (an engine writes its row in its
    own outbox's database), each table named with its database (`outbox (database 'billing')`: another outbox, even
    where its table has this one's name), and a line for each database that could not be read. Each database is
    read once, however many entries name it; one without the status table (status rows off there) has none."""
    places = {_place(dsn)}
    found: list[Any] = []
    unread: list[str] = []
    for entry in outboxes.values() if isinstance(outboxes, Mapping) else ():
        other = entry.get("dsn") if isinstance(entry, Mapping) else None
        if not isinstance(other, str) or database_problem(other) is not None or _place(other) in places:
            continue  # not another database, or one `check` says is wrong
        places.add(_place(other))
        remember_secrets(other)
        label = _place(other)[2]
        try:
            with psycopg.connect(other, connect_timeout=10, autocommit=True) as conn:
                rows, _now = replicas.read(conn, status_table)
        except psycopg.errors.UndefinedTable:
            continue
        except psycopg.Error as error:
            unread.append(f"cannot read the status rows in database {label!r}: {first_line(error)}")
            continue
        for row in rows:
            row.harvested_table = f"{row.harvested_table} (database {label!r})"
        found += rows
    return found, unread


def _place(dsn: str) -> tuple[str, str, str]:
    """Where `dsn` leads (host, port, database name), to read each database once whatever its spelling."""
    try:
        info = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return ("", "", dsn)
    return (str(info.get("host") or ""), str(info.get("port") or "5432"), str(info.get("dbname") or ""))


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:  # run takes no positional argument
        print(f"{PROG}: unknown command {argv[0]!r} (choose from {', '.join(COMMANDS)}; see --help)", file=sys.stderr)
        return 2
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):
        argv = ["run", *argv]
    args = parser().parse_args(argv)
    secrets: set[str] = set()
    try:
        if args.command == "schema":
            schema_command(args, environ)
            return 0
        if args.command == "health":
            return health_command(args, environ)
        if args.command == "reshard" and read_file(args.config)[0].get("outboxes"):
            raise running.RunFailure("reshard: one outbox at a time: give it a --config file without [outboxes], "
                                     "with that outbox's dsn, table and leader_topic")
        settings = build(args, environ)
        secrets = settings.secrets
        if args.command == "check":
            return check(settings)
        if args.command == "reshard":
            return reshard_command(args, settings)
        run(args, settings)
    except running.RunFailure as error:
        print(f"{PROG}: {scrub(str(error), secrets or None)}", file=sys.stderr)
        return 1
    return 0
