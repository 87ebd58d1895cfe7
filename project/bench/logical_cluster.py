"""A private Postgres cluster with logical decoding, for benchmarks that compare the harvester with a CDC relay.

Made like the project's own (bin/services: Debian's Postgres, the same postgresql.conf settings and server
options, pg_stat_statements), plus `wal_level = logical` and room for replication slots, under
.services/postgres-logical/ on a port of its own. Both relays run against it, each in a database of its
own, so they meet the same server. Started on demand and stopped by `stop()`; its data is kept between
runs (the databases are made again by whoever uses them).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import time
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / ".services" / "postgres-logical"
#: What logical decoding needs beyond the project's settings (one slot and one sender per CDC relay).
LOGICAL_SETTINGS = ("wal_level = logical", "max_replication_slots = 4", "max_wal_senders = 4")
#: Settings whose differences from the project's server are expected (the point of this cluster, or where it is).
EXPECTED_DIFFERENCES = {"wal_level", "max_replication_slots", "max_wal_senders", "port", "unix_socket_directories",
                        "data_directory", "config_file", "hba_file", "ident_file", "external_pid_file",
                        "listen_addresses"}


@cache
def bin_services() -> ModuleType:
    """bin/services as a module: its cluster settings and helpers are the one source of truth."""
    loader = importlib.machinery.SourceFileLoader("bin_services", str(ROOT / "bin" / "services"))
    spec = importlib.util.spec_from_loader("bin_services", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


class LogicalCluster:
    """The cluster, as a superuser reaches it (its unix socket, trust) and as roles with passwords do (TCP)."""

    def __init__(self, port: int = 5433, host: str = "127.0.0.1") -> None:
        self.port, self.host = port, host
        self.data = HOME / "data"
        self.sockets = HOME / "run"
        self.log_file = HOME / "postgres.log"
        services = bin_services()
        self._services = services
        self._postgres = services.Postgres()  # for bindir() and owner(): the same install and OS user

    def superuser_dsn(self, database: str = "postgres") -> str:
        return f"host={self.sockets} port={self.port} user=postgres dbname={database}"

    def dsn(self, user: str, password: str, database: str) -> str:
        return f"postgres://{user}:{password}@{self.host}:{self.port}/{database}"

    def up(self) -> None:
        """Make the cluster if it is not there, and start it unless it runs."""
        services = self._services
        if services.reachable(self.host, self.port):
            if not (self.data / "postmaster.pid").exists():
                raise services.ServiceError(f"port {self.port} is taken by another server: pass another --pg-port")
            return
        bindir = self._postgres.bindir()
        if bindir is None:
            raise services.ServiceError("no Postgres installed: run bin/services up first")
        owner = self._postgres.owner()
        HOME.mkdir(parents=True, exist_ok=True)
        self.sockets.mkdir(exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(HOME, owner, owner)
            shutil.chown(self.sockets, owner, owner)
        if not (self.data / "PG_VERSION").exists():
            services.log(f"postgres-logical: initialising a cluster in {self.data}")
            services.run([str(bindir / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth-local=trust",
                          "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8"], user=owner)
            with open(self.data / "postgresql.conf", "a") as conf:
                conf.write("\n# project/bench/logical_cluster.py: bin/services' settings, and logical decoding\n"
                           f"unix_socket_directories = '{self.sockets}'\n"
                           + "".join(f"{line}\n" for line in (*services.CLUSTER_SETTINGS, *LOGICAL_SETTINGS)))
            with open(self.data / "pg_hba.conf", "a") as hba:  # Debezium streams over a replication connection
                hba.write("host replication all 127.0.0.1/32 scram-sha-256\n")
        services.log(f"postgres-logical: starting on {self.host}:{self.port}")
        services.run([str(bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log_file), "-w", "-t", "60", "-o",
                      f"-p {self.port} -c listen_addresses={self.host} {services.SERVER_OPTIONS}", "start"], user=owner)
        services.wait_until(lambda: services.reachable(self.host, self.port), "postgres-logical",
                            log_file=self.log_file)

    def stop(self) -> None:
        bindir = self._postgres.bindir()
        if bindir and (self.data / "postmaster.pid").exists():
            self._services.run([str(bindir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"],
                               user=self._postgres.owner(), check=False)

    def execute(self, statement: str, database: str = "postgres", params: Any = None) -> list[tuple]:
        """A statement as the superuser, autocommit; its rows (if any)."""
        with psycopg.connect(self.superuser_dsn(database), autocommit=True) as conn:
            cursor = conn.execute(statement, params)
            return cursor.fetchall() if cursor.description else []

    def fresh_database(self, name: str, owner: str, password: str, *, replication: bool = False) -> None:
        """A new, empty database owned by `owner` (a login role, made if missing), with pg_stat_statements."""
        for (pid,) in self.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                                   params=[name]):
            self.execute("SELECT pg_terminate_backend(%s)", params=[pid])
        for (slot,) in self.execute("SELECT slot_name FROM pg_replication_slots WHERE database = %s", params=[name]):
            self._drop_slot(slot)
        self.execute(f'DROP DATABASE IF EXISTS "{name}"')
        attributes = "LOGIN" + (" REPLICATION" if replication else "")
        if not self.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", params=[owner]):
            self.execute(f"CREATE ROLE \"{owner}\" {attributes} PASSWORD '{password}'")
        self.execute(f'CREATE DATABASE "{name}" OWNER "{owner}"')
        self.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements", database=name)
        self.execute(f'GRANT pg_read_all_stats TO "{owner}"')

    def _drop_slot(self, slot: str) -> None:
        deadline = time.monotonic() + 30
        while True:  # a walsender may still hold it for a moment after its client went
            try:
                self.execute("SELECT pg_drop_replication_slot(%s)", params=[slot])
                return
            except psycopg.errors.ObjectInUse:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def settings_unlike(self, other_dsn: str) -> list[str]:
        """Settings of this server that differ from the server at `other_dsn` (beyond those expected), as
        `name: ours (theirs)`: the comparison is fair only if there are none."""
        query = "SELECT name, setting FROM pg_settings WHERE source NOT IN ('default', 'override', 'client')"
        ours = dict(self.execute(query))
        with psycopg.connect(other_dsn, autocommit=True) as conn:
            theirs = dict(conn.execute(query).fetchall())
            # A role without pg_read_all_settings does not see some (shared_preload_libraries): not compared.
            visible = {name for (name,) in conn.execute("SELECT name FROM pg_settings").fetchall()}
        names = ((set(ours) | set(theirs)) & visible) - EXPECTED_DIFFERENCES - {"application_name", "client_encoding",
                                                                    "DateStyle", "TimeZone", "lc_messages",
                                                                    "lc_monetary", "lc_numeric", "lc_time",
                                                                    "default_text_search_config", "log_timezone"}
        return [f"{name}: {ours.get(name, 'default')} ({theirs.get(name, 'default')})" for name in sorted(names)
                if ours.get(name) != theirs.get(name)]
