"""`manage.py outbox_bench compare --peer debezium`: the harvester and Debezium on the same workloads, against
the same server, in rounds that alternate which goes first.

The server is a private cluster with logical decoding (logical_cluster.py), made like the project's own; each
relay has a database of its own on it, with goharvest's table (this app's migrations) and an unrelated
table. Writers are processes of their own (writer.py), logging in as a role of their own; each relay logs in
as its own role too, so its server processes (the harvester's sessions, Debezium's walsender) are told apart.

A round runs each relay in turn: the writers alone in its database with it stopped (the baseline of each
steady workload), a drain of a backlog written while it was stopped (timed from its process's start), then
the steady workloads with it running. A relay's added cost is what the server spent with it running minus
what the writers alone cost just before. Every measured stretch starts right after a CHECKPOINT, so each
begins with the same full-page writes to make.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka.admin import AdminClient, NewTopic

from project.bench import dbcost
from project.bench.debezium import DebeziumJars, DebeziumRelay
from project.bench.logical_cluster import LogicalCluster
from project.bench.relays import ROOT, HarvesterRelay, Receiver, Relay, RoleCpu
from project.bench.side_by_side_report import Report, Window

PASSWORD = "bench"
WRITER = "bench_writer"
DATABASES = {"harvester": ("bench_harvest", "bench_harvester"), "debezium": ("bench_debezium", "bench_debezium")}
LOGS = ROOT / ".services" / "side-by-side"
#: Records whose commit came in the first seconds of a steady run are left out of its latencies.
WARMUP = 2.0
PARTITIONS = 8


@dataclass(frozen=True)
class Workload:
    rate: float
    unrelated: float = 0.0

    @property
    def name(self) -> str:
        return f"steady {self.rate:,.0f}/s" + (f" + {self.unrelated:,.0f} unrelated rows/s" if self.unrelated else "")


class SideBySide:
    """Sets the cluster up and runs the rounds; `say` prints a line."""

    def __init__(self, say: Any, bootstrap: str, *, pg_port: int, poll_interval_ms: int,
                 harvest_args: list[str], project_dsn: str, insert: str = "row") -> None:
        self.say, self.bootstrap = say, bootstrap
        self.insert = insert  # the writers: one INSERT a "row", or one a "transaction"
        self.cluster = LogicalCluster(port=pg_port)
        self.jars = DebeziumJars()
        self.project_dsn = project_dsn
        self.admin = AdminClient({"bootstrap.servers": bootstrap})
        database, role = DATABASES["harvester"]
        self.harvester = HarvesterRelay(LOGS / "harvester.log", self.cluster.dsn(role, PASSWORD, database), role,
                                        bootstrap, harvest_args)
        database, role = DATABASES["debezium"]
        self.debezium = DebeziumRelay(self.jars, bootstrap, host=self.cluster.host, port=pg_port, database=database,
                                      user=role, password=PASSWORD, poll_interval_ms=poll_interval_ms)
        self.tmp = Path(tempfile.mkdtemp(prefix="side-by-side-"))

    # -- set-up ------------------------------------------------------------------------------------

    def setup(self) -> None:
        self.jars.resolve(self.say)
        self.cluster.up()
        unlike = self.cluster.settings_unlike(self.project_dsn)
        self.say(f"server: {self.cluster.execute('SHOW server_version')[0][0]} on {self.cluster.host}:"
                 f"{self.cluster.port} with wal_level=logical; settings unlike the project's server: "
                 f"{'; '.join(unlike) if unlike else 'none'}")
        self.debezium.forget()
        for relay, (database, role) in DATABASES.items():
            self.cluster.fresh_database(database, role, PASSWORD, replication=relay == "debezium")
            self._migrate(self.cluster.dsn(role, PASSWORD, database))
            self.cluster.execute("CREATE TABLE unrelated (id bigserial PRIMARY KEY, at timestamptz NOT NULL DEFAULT "
                                 "now(), account integer NOT NULL, amount numeric(12, 2) NOT NULL, note text NOT NULL)",
                                 database)
            if not self.cluster.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", params=[WRITER]):
                self.cluster.execute(f"CREATE ROLE {WRITER} LOGIN PASSWORD '{PASSWORD}'")
            self.cluster.execute(f"GRANT SELECT, INSERT ON outbox, unrelated TO {WRITER}; "
                                 f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {WRITER}", database)
        # Debezium's first start makes its slot and publication (untimed); later starts find them caught up.
        self.say("debezium: first start (makes its replication slot and publication)")
        self._catch_up(self.debezium)

    def _migrate(self, dsn: str) -> None:
        done = subprocess.run([sys.executable, str(ROOT / "manage.py"), "migrate", "--noinput", "-v", "0"],
                              env={**os.environ, "DATABASE_URL": dsn}, capture_output=True, text=True, cwd=ROOT)
        if done.returncode:
            raise RuntimeError(f"migrate failed: {(done.stdout + done.stderr).strip().splitlines()[-1:]}")

    def close(self) -> None:
        """Stop what the benchmark started: the relays, the private cluster (its data is kept for the next run)."""
        self.harvester.stop()
        self.debezium.stop()
        self.cluster.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- helpers -----------------------------------------------------------------------------------

    def _database(self, relay: Relay) -> str:
        return DATABASES[relay.name][0]

    def _writer_dsn(self, relay: Relay) -> str:
        return self.cluster.dsn(WRITER, PASSWORD, self._database(relay))

    def _writer_env(self, relay: Relay) -> dict[str, str]:
        """A writer's environment: its DSN in DATABASE_URL, never on a command line `ps` shows."""
        return {**os.environ, "DATABASE_URL": self._writer_dsn(relay)}

    def _topic(self, prefix: str) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.admin.create_topics([NewTopic(name, num_partitions=PARTITIONS)])[name].result(timeout=30)
        return name

    def _fresh_table(self, relay: Relay) -> None:
        database = self._database(relay)
        self.cluster.execute("TRUNCATE outbox", database)
        self.cluster.execute("VACUUM ANALYZE outbox", database)

    def _meter(self, relay: Relay) -> dbcost.ServerMeter:
        return dbcost.ServerMeter(psycopg.connect(self.cluster.superuser_dsn(self._database(relay)), autocommit=True))

    def _writers(self, relay: Relay, topic: str, workload: Workload, duration: float) -> Path:
        """The workload's writers, started together; returns the file of commit times once they are done."""
        times = self.tmp / f"{topic}.commits"
        records = int(workload.rate * duration)
        env = self._writer_env(relay)
        writers = [subprocess.Popen([sys.executable, "-m", "project.bench.writer", "outbox",
                                     "--topic", topic, "--records", str(records), "--rate", str(workload.rate),
                                     "--batch", str(max(1, int(workload.rate / 100))), "--out", str(times),
                                     "--insert", self.insert],
                                    cwd=ROOT, env=env)]
        if workload.unrelated:
            writers.append(subprocess.Popen([sys.executable, "-m", "project.bench.writer", "unrelated",
                                             "--rate", str(workload.unrelated), "--duration", str(duration),
                                             "--batch", "50"], cwd=ROOT, env=env))
        for writer in writers:
            if writer.wait() != 0:
                raise RuntimeError(f"a writer failed with exit code {writer.returncode}")
        return times

    def _probe(self, relay: Relay, timeout: float = 180) -> None:
        """One record through the relay: it publishes what is committed now (a CDC relay has decoded the WAL
        up to here)."""
        topic = self._topic("bench-probe")
        receiver = Receiver(self.bootstrap, topic, relay.id_header)
        receiver.start()
        receiver.assigned.wait(30)
        with psycopg.connect(self._writer_dsn(relay), autocommit=True) as conn:
            conn.execute("INSERT INTO outbox (create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, "
                         "kafka_header_values) VALUES (now(), %s, 'probe', 'probe', '{}', '{}')", [topic])
        arrived = receiver.wait_for(1, timeout, relay)
        receiver.stop()
        self.admin.delete_topics([topic])
        if not arrived:
            raise RuntimeError(f"{relay.name} did not publish a probe within {timeout:.0f} s: {relay.log_tail()}")

    def _ready(self, relay: Relay) -> None:
        if isinstance(relay, DebeziumRelay):
            relay.wait_streaming(self.cluster.superuser_dsn(self._database(relay)))
        else:
            deadline = time.monotonic() + 120
            while not relay.led():
                if not relay.alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"the harvester did not lead: {relay.log_tail()}")
                time.sleep(0.05)
        self._probe(relay)

    def _catch_up(self, relay: DebeziumRelay) -> None:
        """Start, publish to the end of the WAL, let the slot's restart point follow, stop: a timed start then
        decodes only what was written after (../shared/peers/debezium.md, pitfalls)."""
        dsn = self.cluster.superuser_dsn(self._database(relay))
        relay.start()
        self._ready(relay)
        deadline = time.monotonic() + 120
        while (relay.slot_lag(dsn) or 0) > 1_000_000:
            if time.monotonic() > deadline:
                raise RuntimeError(f"Debezium's slot stayed {relay.slot_lag(dsn):,} bytes behind")
            self.cluster.execute("CHECKPOINT")
            self._probe(relay)
            time.sleep(1.5)  # an offset flush (every second) confirms the probe to the slot
        relay.stop()

    # -- the measured stretches --------------------------------------------------------------------

    def steady(self, relay: Relay, workload: Workload, duration: float, *, alone: bool = False) -> Window:
        """The workload for `duration` seconds in the relay's database, with the relay running (and ready), or,
        `alone`, with it stopped: the writers' own cost, its baseline."""
        self._fresh_table(relay)
        topic = self._topic("bench-side")
        receiver = None
        if not alone:
            receiver = Receiver(self.bootstrap, topic, relay.id_header)
            receiver.start()
            receiver.assigned.wait(30)
            relay.reset_peak()
        meter, backends = self._meter(relay), RoleCpu(self.cluster.superuser_dsn(), WRITER if alone else relay.role)
        self.cluster.execute("CHECKPOINT")
        before, cpu = meter.read(), 0.0 if alone else relay.cpu()
        backends.start()
        began = time.time()
        commits = self._writers(relay, topic, workload, duration)
        committed = dict(_commit_times(commits))
        if receiver is not None and not receiver.wait_for(len(committed), 120, relay):
            raise RuntimeError(f"{relay.name} published {len(receiver.received):,} of {len(committed):,} records: "
                               f"{relay.log_tail()}")
        ended = time.time()
        after = meter.read()
        window = Window(records=len(committed), seconds=ended - began, server=after - before,
                        backends_cpu=backends.stop(), relay_cpu=0.0 if alone else relay.cpu() - cpu,
                        relay_rss=0 if alone else relay.peak_rss)
        meter.conn.close()
        if receiver is not None:
            receiver.stop()
            first = min(committed.values()) + WARMUP
            window.latencies = sorted((receiver.received[i] - at) * 1000 for i, at in committed.items()
                                      if at >= first and i in receiver.received)
        self.admin.delete_topics([topic])
        return window

    def drain(self, relay: Relay, records: int) -> tuple[Window, Window]:
        """A backlog written while the relay was stopped, then published from its process's start: (what
        writing it cost, what publishing it cost)."""
        self._fresh_table(relay)
        if isinstance(relay, DebeziumRelay):
            self._catch_up(relay)
        topic = self._topic("bench-drain")
        receiver = Receiver(self.bootstrap, topic, relay.id_header)
        receiver.start()
        receiver.assigned.wait(30)
        meter = self._meter(relay)
        self.cluster.execute("CHECKPOINT")
        before = meter.read()
        began = time.time()
        subprocess.run([sys.executable, "-m", "project.bench.writer", "backlog", "--topic", topic, "--records",
                        str(records)], cwd=ROOT, env=self._writer_env(relay), check=True)
        written_at = time.time()
        written = meter.read()
        backends = RoleCpu(self.cluster.superuser_dsn(), relay.role)
        backends.start()
        started = relay.start()
        if not receiver.wait_for(records, 900, relay):
            raise RuntimeError(f"{relay.name} published {len(receiver.received):,} of {records:,} records: "
                               f"{relay.log_tail()}")
        last = max(receiver.received.values())
        if isinstance(relay, HarvesterRelay):  # its work ends with the last purge
            with psycopg.connect(self.cluster.superuser_dsn(self._database(relay)), autocommit=True) as conn:
                while conn.execute("/* bench */ SELECT EXISTS (SELECT 1 FROM outbox)").fetchone()[0]:
                    time.sleep(0.1)
        published = meter.read()
        writer = Window(records=records, seconds=written_at - began, server=written - before, backends_cpu=0.0,
                        relay_cpu=0.0, relay_rss=0)
        window = Window(records=records, seconds=last - started, server=published - written,
                        backends_cpu=backends.stop(), relay_cpu=relay.cpu(), relay_rss=relay.peak_rss,
                        first_to_last=last - min(receiver.received.values()))
        meter.conn.close()
        receiver.stop()
        self.admin.delete_topics([topic])
        return writer, window

    # -- rounds ------------------------------------------------------------------------------------

    def run(self, rounds: int, records: int, workloads: list[Workload], duration: float) -> Report:
        report = Report(workloads=[w.name for w in workloads], records=records)
        try:
            for number in range(1, rounds + 1):
                order = [self.harvester, self.debezium] if number % 2 else [self.debezium, self.harvester]
                self.say(f"round {number} of {rounds}: {' then '.join(r.name for r in order)}")
                for relay in order:
                    # Its baselines just before it runs, in its database: the server drifts over a round.
                    for workload in workloads:
                        window = self.steady(relay, workload, duration, alone=True)
                        report.add(number, workload.name, "writers", window, relay=relay.name)
                        self.say(f"  writers alone before {relay.name}, {workload.name}: {report.line(window)}")
                    if records:
                        writer, window = self.drain(relay, records)
                        report.add(number, "drain", "writers", writer, relay=relay.name)
                        report.add(number, "drain", relay.name, window)
                        self.say(f"  {relay.name}, drain of {records:,}: {report.line(window, writer)}")
                    if not relay.alive():
                        relay.start()
                    self._ready(relay)
                    for workload in workloads:
                        window = self.steady(relay, workload, duration)
                        report.add(number, workload.name, relay.name, window)
                        self.say(f"  {relay.name}, {workload.name}: "
                                 f"{report.line(window, report.baseline(number, workload.name, relay.name))}")
                    relay.stop()
        finally:
            self.harvester.stop()
            self.debezium.stop()
        return report


def _commit_times(path: Path) -> list[tuple[int, float]]:
    pairs = []
    for line in path.read_text().splitlines():
        record_id, at = line.split()
        pairs.append((int(record_id), float(at)))
    return pairs
