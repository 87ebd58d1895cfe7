"""`manage.py outbox_many_bench`: what N idle tenant outboxes cost the database, harvested by P processes
(`harvest --tenant-schemas`) or, as the baseline, by one `harvest --table schema.outbox` process each.

    python manage.py outbox_many_bench --schemas 10 --processes 2 --seconds 60
    python manage.py outbox_many_bench --schemas 10 --separate --seconds 60      # the baseline

It makes schemas bench_t0..N-1 (an outbox table and its NOTIFY trigger each), starts the harvesters,
waits until every outbox has a leader (its status row), lets them settle, then counts over `--seconds`
what the database ran: statements (pg_stat_statements, this database only, the benchmark's own left
out), transactions (pg_stat_database), and the sessions the harvesters hold; and the harvesters' CPU.
Run it against a database of its own (DATABASE_URL), migrated first (`manage.py migrate`): the figures are the
whole database's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import psycopg
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from psycopg import sql

from outbox import conf
from outbox.reasons import first_line

ROOT = Path(settings.BASE_DIR)
PREFIX = "bench_t"
OWN = "outbox_many_bench"  # the benchmark's own statements carry this comment, and are left out
#: bin/services' superuser, which may create pg_stat_statements (tests/support/statement_stats.py).
SUPERUSER = ("postgres", "postgres")


class Command(BaseCommand):
    help = "What N idle tenant outboxes cost the database: harvested together or one process each (the baseline)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--schemas", type=int, default=10)
        parser.add_argument("--processes", type=int, default=2, help="harvest --tenant-schemas processes")
        parser.add_argument("--separate", action="store_true", help="the baseline: one harvest process per outbox")
        parser.add_argument("--seconds", type=float, default=60.0)
        parser.add_argument("--settle", type=float, default=10.0, help="seconds after every outbox leads")
        parser.add_argument("--harvest-arg", action="append", default=[], dest="harvest_args")

    def handle(self, *args: Any, **options: Any) -> None:
        dsn = conf.dsn_for("default")
        schemas = [f"{PREFIX}{i}" for i in range(options["schemas"])]
        try:
            conn = psycopg.connect(dsn, autocommit=True)
        except psycopg.OperationalError as error:
            raise CommandError(f"cannot connect to the database: {first_line(error)}") from None
        with conn:
            self._check_migrated(conn, dsn)
            self._make_schemas(conn, schemas)
            statements = self._statements_on(conn, dsn)
            if options["separate"]:
                # Each its own leader group (the example project's settings name one for the default table).
                commands = [["--table", f"{schema}.outbox", "--leader-topic", f"bench-many-{schema}",
                             "--leader-group", f"bench-many-{schema}", "--name", f"bench-{schema}"]
                            for schema in schemas]
                what = f"{len(schemas)} outboxes, one harvest process each (the baseline)"
            else:
                commands = [["--tenant-schemas", "--exclude-schema", "public", "--name", f"bench-many-{i}"]
                            for i in range(options["processes"])]
                what = f"{len(schemas)} outboxes, {options['processes']} harvest --tenant-schemas process(es)"
            self.stdout.write(f"idle outboxes: {what}; {options['seconds']:.0f}s measured")
            processes = [self._spawn([*command, *options["harvest_args"]]) for command in commands]
            try:
                self._wait_for_leaders(conn, schemas, processes)
                time.sleep(options["settle"])
                before = self._read(conn, statements, processes)
                began = time.monotonic()
                time.sleep(options["seconds"])
                after = self._read(conn, statements, processes)
                elapsed = time.monotonic() - began
                sessions = conn.execute(f"/* {OWN} */ SELECT split_part(application_name, ' ', 1), count(*) "
                                        "FROM pg_stat_activity WHERE datname = current_database() AND "
                                        "application_name LIKE 'outbox-harvest-%%' GROUP BY 1 ORDER BY 1").fetchall()
            finally:
                for process in processes:
                    process.terminate()
                for process in processes:
                    try:
                        process.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        process.kill()
                self._drop_schemas(conn, schemas)
        self._report(before, after, elapsed, sessions)

    # -- set-up ---------------------------------------------------------------------------------------

    def _check_migrated(self, conn: psycopg.Connection, dsn: str) -> None:
        """Each schema's outbox is made LIKE public.outbox, and leaders are counted from the status table: both come
        from the project's migrations, which a database made for the benchmark does not have yet."""
        missing = [table for table in ("outbox", "outbox_harvester")
                   if conn.execute("SELECT to_regclass(%s) IS NULL", [f"public.{table}"]).fetchone()[0]]
        if missing:
            database = psycopg.conninfo.conninfo_to_dict(dsn).get("dbname")
            raise CommandError(f"database {database} has no table {' or '.join(missing)}: migrate it first "
                               f"(DATABASE_URL=<its URL> manage.py migrate)")

    def _make_schemas(self, conn: psycopg.Connection, schemas: list[str]) -> None:
        self._drop_schemas(conn, [row[0] for row in conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'bench\\_t%%'").fetchall()])
        for schema in schemas:
            ident = sql.Identifier(schema)
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(ident))
            conn.execute(sql.SQL("CREATE TABLE {}.outbox (LIKE public.outbox INCLUDING ALL)").format(ident))
            conn.execute(sql.SQL("CREATE TRIGGER outbox_notify AFTER INSERT ON {}.outbox FOR EACH STATEMENT "
                                 "EXECUTE FUNCTION public.outbox_notify()").format(ident))

    def _drop_schemas(self, conn: psycopg.Connection, schemas: list[str]) -> None:
        for schema in schemas:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))

    def _statements_on(self, conn: psycopg.Connection, dsn: str) -> bool:
        if conn.execute("SELECT to_regclass('pg_stat_statements')").fetchone()[0] is None:
            info = psycopg.conninfo.conninfo_to_dict(dsn)
            try:
                with psycopg.connect(psycopg.conninfo.make_conninfo(dsn, user=SUPERUSER[0], password=SUPERUSER[1]),
                                     autocommit=True) as superuser:
                    superuser.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            except psycopg.Error as error:
                self.stderr.write(f"pg_stat_statements unavailable in {info.get('dbname')}: {error}; "
                                  "counting transactions only")
                return False
        try:
            conn.execute("SELECT 1 FROM pg_stat_statements LIMIT 1")
        except psycopg.Error as error:
            self.stderr.write(f"pg_stat_statements unreadable: {error}; counting transactions only")
            return False
        return True

    def _spawn(self, args: list[str]) -> subprocess.Popen:
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings", "PYTHONUNBUFFERED": "1"}
        logs = ROOT / ".artifacts" / "many-bench"
        logs.mkdir(parents=True, exist_ok=True)
        log = open(logs / f"{args[args.index('--name') + 1]}.log", "w")  # noqa: SIM115 - the child's
        return subprocess.Popen([sys.executable, str(ROOT / "manage.py"), "harvest", *args], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)

    def _wait_for_leaders(self, conn: psycopg.Connection, schemas: list[str], processes: list[Any]) -> None:
        deadline = time.monotonic() + 60 + 3 * len(schemas)
        tables = [f"{schema}.outbox" for schema in schemas]
        while True:
            led = conn.execute(f"/* {OWN} */ SELECT count(DISTINCT harvested_table) FROM outbox_harvester "
                               "WHERE state = 'leader' AND last_seen > now() - interval '10 seconds' "
                               "AND harvested_table = ANY(%s)", [tables]).fetchone()[0]
            if led == len(schemas):
                return
            dead = [p.args for p in processes if p.poll() is not None]
            if dead:
                raise CommandError(f"a harvester exited: {dead[0]}")
            if time.monotonic() > deadline:
                raise CommandError(f"only {led} of {len(schemas)} outboxes have a leader after the deadline")
            time.sleep(0.5)

    # -- measuring ------------------------------------------------------------------------------------

    def _read(self, conn: psycopg.Connection, statements: bool, processes: list[Any]) -> dict[str, Any]:
        found: dict[str, Any] = {"at": time.monotonic()}
        found["xacts"] = conn.execute(f"/* {OWN} */ SELECT xact_commit + xact_rollback FROM pg_stat_database "
                                      "WHERE datname = current_database()").fetchone()[0]
        if statements:
            found["statements"] = dict(conn.execute(
                f"/* {OWN} */ SELECT query, sum(calls)::bigint FROM pg_stat_statements "
                "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
                "AND query NOT LIKE %s GROUP BY query", [f"%{OWN}%"]).fetchall())
        cpu = 0.0
        for process in processes:
            try:
                tree = psutil.Process(process.pid)
                for each in (tree, *tree.children(recursive=True)):
                    times = each.cpu_times()
                    cpu += times.user + times.system
            except psutil.NoSuchProcess:
                pass
        found["cpu"] = cpu
        return found

    def _report(self, before: dict[str, Any], after: dict[str, Any], elapsed: float,
                sessions: list[tuple[str, int]]) -> None:
        write = self.stdout.write
        write(f"  transactions: {(after['xacts'] - before['xacts']) / elapsed:.2f}/s "
              "(pg_stat_database; its counters lag by up to a few seconds)")
        if "statements" in after:
            calls = {query: count - before["statements"].get(query, 0) for query, count in after["statements"].items()}
            total = sum(calls.values())
            write(f"  statements: {total / elapsed:.2f}/s (pg_stat_statements)")
            for query, count in sorted(calls.items(), key=lambda item: -item[1])[:8]:
                if count:
                    write(f"    {count / elapsed:7.2f}/s  {' '.join(query.split())[:110]}")
        write(f"  harvesters' CPU: {100 * (after['cpu'] - before['cpu']) / elapsed:.1f}% of a core")
        kinds = ", ".join(f"{name.removeprefix('outbox-harvest-')} {count}" for name, count in sessions)
        write(f"  sessions: {sum(count for _name, count in sessions)} ({kinds})")
