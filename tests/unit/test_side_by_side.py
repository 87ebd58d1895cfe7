"""`outbox_bench compare --peer debezium`, the parts that need no server: its report, the Debezium worker's
configuration, the private cluster's settings and the command's refusals. (Running it takes a JVM, Maven
Central and a second Postgres cluster: docs/benchmarks.md has a run.)"""

from __future__ import annotations

import re
from io import StringIO

import psycopg
import pytest
from django.core.management import CommandError, call_command

from outbox import conf
from project.bench import debezium, logical_cluster
from project.bench.dbcost import Cost, Statements
from project.bench.side_by_side import Workload
from project.bench.side_by_side_report import Report, Window


def window(records: int, seconds: float, cpu: float, wal: int, **more: object) -> Window:
    return Window(records=records, seconds=seconds, server=Cost(cpu, wal, Statements()), backends_cpu=more.pop(
        "backends", 0.0), relay_cpu=more.pop("relay_cpu", 0.0), relay_rss=more.pop("rss", 0), **more)


def rows(lines: list[str], title: str) -> dict[str, list[str]]:
    """The table under `title`: label -> cells."""
    start = next(i for i, line in enumerate(lines) if line.startswith(f"**{title}"))
    found = {}
    for line in lines[start + 4:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        found[cells[0]] = cells[1:]
    return found


def test_the_report_gives_medians_their_range_and_the_harvesters_over_debeziums():
    report = Report(workloads=["steady 2,000/s"], records=1000)
    for number, (ours, theirs) in enumerate([(0.5, 1.0), (0.7, 1.2), (0.6, 1.1)], start=1):
        report.add(number, "steady 2,000/s", "writers", window(2000, 10, 1.0, 1000), relay="harvester")
        report.add(number, "steady 2,000/s", "writers", window(2000, 10, 0.9, 1000), relay="debezium")
        report.add(number, "steady 2,000/s", "harvester",
                   window(2000, 10, 1.0 + ours, 1000 + 2000 * 80, latencies=[1.0, 2.0, 3.0, 4.0]))
        report.add(number, "steady 2,000/s", "debezium", window(2000, 10, 0.9 + theirs, 1000, latencies=[400.0] * 4))
        report.add(number, "drain", "writers", window(1000, 1, 0.2, 100_000), relay="harvester")
        report.add(number, "drain", "harvester", window(1000, 0.5, 0.1, 20_000, first_to_last=0.25))
        report.add(number, "drain", "writers", window(1000, 1, 0.2, 100_000), relay="debezium")
        report.add(number, "drain", "debezium", window(1000, 2, 0.3, 0, first_to_last=1.0))
    lines = report.table()
    assert lines[0].startswith("Median of 3 round(s)")
    assert "**steady 2,000/s** (the writers alone: Postgres CPU 1.00 s before harvester, 0.90 s before debezium)" \
        in lines, "each relay beside its own baseline"
    steady = rows(lines, "steady 2,000/s")
    assert steady["Postgres CPU added, whole server, s"] == ["0.60 (0.50 to 0.70)", "1.10 (1.00 to 1.20)", "0.55"]
    assert steady["Postgres CPU added over the writers' own"] == ["0.60x (0.50x to 0.70x)", "1.22x (1.11x to 1.33x)",
                                                                  "0.49"]
    assert steady["commit to receipt p50, ms"][:2] == ["3.0", "400.0"]
    assert steady["WAL added, bytes per record"] == ["80", "0", "n/a"], "Debezium writes none: nothing to divide by"
    drain = rows(lines, "drain of 1,000 rows")
    assert drain["records/s from process start"] == ["2,000", "500", "4.00"]
    assert drain["records/s, first to last message"] == ["4,000", "1,000", "4.00"]
    assert drain["Postgres CPU over the insert's"] == ["0.50x", "1.50x", "0.33"], "each beside the insert it drained"
    assert drain["WAL, bytes per record"] == ["20", "0", "n/a"]
    assert drain["WAL over the insert's"] == ["0.20x", "0.00x", "n/a"]


def test_a_line_says_a_steady_run_beside_its_writers_and_a_drain_beside_its_insert():
    base = window(2000, 10, 1.0, 1000)
    steady = window(2000, 10, 1.5, 1000 + 2000 * 90, latencies=[float(i) for i in range(100)], relay_cpu=2.0,
                    rss=80 * 2**20, backends=0.4)
    line = Report.line(steady, base)
    assert "p50 50.0 / p95 95.0 / p99 99.0 ms" in line and "Postgres CPU +0.50 s = 0.50x the writers' own" in line
    assert "the relay's own processes 0.40 s" in line and "WAL +90 B/record" in line and "RSS 80 MiB" in line
    drain = Report.line(window(1000, 0.5, 0.1, 20_000, first_to_last=0.25), window(1000, 1, 0.2, 100_000))
    assert "2,000 records/s from process start (4,000 first to last)" in drain
    assert "0.50x the insert's" in drain and "WAL 20 B/record = 0.20x the insert's" in drain


def test_the_workloads_are_named_as_the_report_shows_them():
    assert Workload(2000).name == "steady 2,000/s"
    assert Workload(2000, 5000).name == "steady 2,000/s + 5,000 unrelated rows/s"


def test_the_worker_runs_the_connector_on_goharvests_table_at_the_pinned_versions(tmp_path, monkeypatch):
    monkeypatch.setattr(debezium, "HOME", tmp_path)
    jars = debezium.DebeziumJars()
    assert (jars.debezium, jars.kafka) == ("3.7.0.Final", "4.3.1")
    relay = debezium.DebeziumRelay(jars, "127.0.0.1:9092", host="127.0.0.1", port=5433, database="bench_debezium",
                                   user="bench_debezium", password="bench", poll_interval_ms=10)
    relay.run_dir = tmp_path / "run"
    args, _ = relay.command()
    assert args[-3:] == ["org.apache.kafka.connect.cli.ConnectStandalone", str(relay.run_dir / "worker.properties"),
                         str(relay.run_dir / "connector.properties")]
    assert f"{jars.connect}/*" in args
    connector = dict(line.split("=", 1) for line in (relay.run_dir / "connector.properties").read_text().splitlines())
    assert connector["plugin.name"] == "pgoutput" and connector["table.include.list"] == "public.outbox"
    assert connector["snapshot.mode"] == "no_data" and connector["poll.interval.ms"] == "10"
    assert connector["transforms.outbox.table.field.event.key"] == "kafka_key"
    assert connector["transforms.outbox.table.field.event.payload"] == "kafka_value"
    assert connector["transforms.outbox.route.by.field"] == "kafka_topic"
    assert connector["database.port"] == "5433" and connector["database.dbname"] == "bench_debezium"
    worker = (relay.run_dir / "worker.properties").read_text()
    assert "offset.flush.interval.ms=1000" in worker and f"plugin.path={jars.plugins}" in worker
    port = int(re.search(r"listeners=http://127.0.0.1:(\d+)", worker).group(1))
    assert port not in (9092, 5432, 8083), "a free port of its own for Connect's REST listener"


def test_the_private_cluster_takes_the_projects_settings_and_logical_decoding():
    services = logical_cluster.bin_services()
    assert "shared_buffers = 512MB" in services.CLUSTER_SETTINGS
    assert "wal_level = logical" in logical_cluster.LOGICAL_SETTINGS
    cluster = logical_cluster.LogicalCluster(port=5433)
    assert cluster.port == 5433 and cluster.data.parts[-3:] == (".services", "postgres-logical", "data")


@pytest.mark.parametrize(("args", "said"), [
    (["--rounds", "0"], "--rounds: must be at least 1, got 0"),
    (["--duration", "0.5"], "--duration: must be at least 1, got 0.5"),
    (["--rate", "-5"], "--rate and --unrelated-rate: must be positive"),
    (["--pg-port", "OWN"], "--pg-port: OWN is the project's own Postgres"),
])
def test_the_command_refuses_bad_figures_in_one_line_naming_the_option(args, said):
    own = str(psycopg.conninfo.conninfo_to_dict(conf.harvest_config().dsn).get("port") or 5432)  # DATABASE_URL's
    args, said = [own if arg == "OWN" else arg for arg in args], said.replace("OWN", own)
    with pytest.raises(CommandError, match=re.escape(said)):
        call_command("outbox_bench", "compare", "--peer", "debezium", *args, stdout=StringIO())


def test_goharvest_as_the_peer_needs_its_reaper():
    with pytest.raises(CommandError, match=r"--reaper: required with --peer goharvest"):
        call_command("outbox_bench", "compare", stdout=StringIO())
