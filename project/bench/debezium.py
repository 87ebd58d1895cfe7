"""Debezium as the harvester's peer: its Postgres connector and the Outbox Event Router on a Kafka Connect
standalone worker, run with plain `java` (no Docker) from jars resolved from Maven Central at the versions
services/debezium/pom.xml pins.

The jars (about 65 MB) are fetched on the benchmark's first run, not by `bin/services up`: nothing else
needs them, and every developer and CI run would pay for them otherwise. Maven's cache (~/.m2) keeps them;
a changed pom is resolved again into a clean folder.

The connector reads goharvest's table as the Outbox Event Router expects it (../shared/peers/debezium.md):
key `kafka_key`, value `kafka_value`, topic from `kafka_topic`, the row's id in a header `id`.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import socket
import subprocess
import time

import psycopg

from project.bench.logical_cluster import bin_services
from project.bench.relays import ROOT, Relay

POM = ROOT / "services" / "debezium" / "pom.xml"
HOME = ROOT / ".services" / "debezium"
#: From the plugin folder: jars the worker has its own of (the worker's are used).
WORKER_OWN = ("connect-api-", "kafka-clients-", "slf4j-api-", "lz4-java-", "snappy-java-", "zstd-jni-")
SLOT = "dbz_outbox"
PUBLICATION = "dbz_outbox_pub"
HEAP = ("-Xms1g", "-Xmx1g")
#: Debezium's default poll.interval.ms.
DEFAULT_POLL_MS = 500


def pinned(name: str) -> str:
    found = re.search(rf"<{re.escape(name)}>(.+?)</{re.escape(name)}>", POM.read_text())
    assert found, f"services/debezium/pom.xml pins no {name}"
    return found.group(1)


class DebeziumJars:
    """The worker's classpath and the connector's plugin folder, resolved on first use."""

    def __init__(self) -> None:
        self.debezium, self.kafka = pinned("debezium.version"), pinned("kafka.version")
        self.connect = HOME / f"connect-{self.kafka}"
        self.plugins = HOME / f"plugins-{self.debezium}"
        self.stamp = f"{self.debezium} {self.kafka} {hashlib.sha256(POM.read_bytes()).hexdigest()[:16]}"

    def current(self) -> bool:
        return all((folder / ".complete").exists() and (folder / ".complete").read_text() == self.stamp
                   for folder in (self.connect, self.plugins))

    def resolve(self, say=print) -> None:
        if self.current():
            return
        if not shutil.which("java") or not shutil.which("mvn"):
            raise bin_services().ServiceError("java and mvn are needed: `bin/services up` installs them")
        say(f"fetching Debezium {self.debezium} and Kafka Connect {self.kafka} from Maven Central into {HOME} "
            "(once)")
        for folder, profile, into in ((self.connect, "connect", self.connect),
                                      (self.plugins, "connector", self.plugins / "debezium-connector-postgres")):
            shutil.rmtree(folder, ignore_errors=True)
            into.mkdir(parents=True)
            done = subprocess.run(["mvn", "-B", "-q", "-f", str(POM), "-P", profile, "dependency:copy-dependencies",
                                   f"-DoutputDirectory={into}", "-DincludeScope=runtime"], capture_output=True,
                                  text=True)
            if done.returncode:
                detail = (done.stdout + done.stderr).strip().splitlines()
                raise bin_services().ServiceError(f"mvn -P {profile} failed: "
                                                  f"{detail[-1] if detail else done.returncode}")
            if profile == "connector":
                for jar in into.iterdir():
                    if jar.name.startswith(WORKER_OWN):
                        jar.unlink()
            (folder / ".complete").write_text(self.stamp)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class DebeziumRelay(Relay):
    """A Connect standalone worker running the Postgres connector on the benchmark's own database."""

    name = "debezium"
    id_header = "id"

    def __init__(self, jars: DebeziumJars, bootstrap: str, *, host: str, port: int, database: str, user: str,
                 password: str, poll_interval_ms: int = DEFAULT_POLL_MS) -> None:
        super().__init__(HOME / "run" / "connect.log")
        self.jars, self.bootstrap = jars, bootstrap
        self.host, self.port, self.database, self.role, self.password = host, port, database, user, password
        self.poll_interval_ms = poll_interval_ms
        self.run_dir = HOME / "run"
        self.offsets = self.run_dir / "offsets.dat"

    def forget(self) -> None:
        """Start over: no offsets (the slot goes with its database; the two must go together)."""
        self.offsets.unlink(missing_ok=True)

    def command(self) -> tuple[list[str], dict[str, str]]:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        worker, connector, logging = (self.run_dir / name for name in ("worker.properties", "connector.properties",
                                                                      "log4j2.properties"))
        worker.write_text(
            f"bootstrap.servers={self.bootstrap}\n"
            "key.converter=org.apache.kafka.connect.storage.StringConverter\n"
            "value.converter=org.apache.kafka.connect.storage.StringConverter\n"
            f"offset.storage.file.filename={self.offsets}\n"
            # Debezium confirms to the slot only when offsets are flushed: every second, so a stopped worker
            # leaves its slot caught up (the default, 60 s, leaves it far behind).
            "offset.flush.interval.ms=1000\n"
            f"plugin.path={self.jars.plugins}\n"
            f"listeners=http://127.0.0.1:{free_port()}\n")
        connector.write_text(
            "name=outbox-bench\n"
            "connector.class=io.debezium.connector.postgresql.PostgresConnector\n"
            "tasks.max=1\n"
            f"database.hostname={self.host}\ndatabase.port={self.port}\ndatabase.user={self.role}\n"
            f"database.password={self.password}\ndatabase.dbname={self.database}\n"
            "topic.prefix=bench\n"
            f"plugin.name=pgoutput\nslot.name={SLOT}\npublication.name={PUBLICATION}\n"
            "publication.autocreate.mode=filtered\n"
            "table.include.list=public.outbox\n"
            "snapshot.mode=no_data\n"
            "tombstones.on.delete=false\n"
            f"poll.interval.ms={self.poll_interval_ms}\n"
            "key.converter=org.apache.kafka.connect.storage.StringConverter\n"
            "value.converter=org.apache.kafka.connect.storage.StringConverter\n"
            "transforms=outbox\n"
            "transforms.outbox.type=io.debezium.transforms.outbox.EventRouter\n"
            "transforms.outbox.table.field.event.id=id\n"
            "transforms.outbox.table.field.event.key=kafka_key\n"
            "transforms.outbox.table.field.event.payload=kafka_value\n"
            "transforms.outbox.route.by.field=kafka_topic\n"
            "transforms.outbox.route.topic.replacement=${routedByValue}\n")
        logging.write_text(
            "status = warn\n"
            "appender.file.type = Console\nappender.file.name = OUT\n"
            "appender.file.layout.type = PatternLayout\nappender.file.layout.pattern = [%d] %p %m (%c)%n\n"
            "rootLogger.level = WARN\nrootLogger.appenderRef.out.ref = OUT\n"
            "logger.debezium.name = io.debezium\nlogger.debezium.level = INFO\n")
        return (["java", *HEAP, "-XX:+UseG1GC", "-Djava.awt.headless=true",
                 f"-Dlog4j2.configurationFile={logging}", "-cp", f"{self.jars.connect}/*",
                 "org.apache.kafka.connect.cli.ConnectStandalone", str(worker), str(connector)], {})

    def streaming(self, superuser_dsn: str) -> bool:
        """Whether its slot exists and a walsender streams from it."""
        with psycopg.connect(superuser_dsn, autocommit=True) as conn:
            row = conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", [SLOT]).fetchone()
        return bool(row and row[0])

    def slot_lag(self, superuser_dsn: str) -> int | None:
        """Bytes of WAL between the server's position and the slot's restart point (what a start decodes)."""
        with psycopg.connect(superuser_dsn, autocommit=True) as conn:
            row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint "
                               "FROM pg_replication_slots WHERE slot_name = %s", [SLOT]).fetchone()
        return None if row is None else int(row[0])

    def wait_streaming(self, superuser_dsn: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not self.streaming(superuser_dsn):
            if not self.alive():
                raise RuntimeError(f"Kafka Connect exited: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"Debezium did not stream within {timeout:.0f} s: {self.log_tail()}")
            time.sleep(0.2)
