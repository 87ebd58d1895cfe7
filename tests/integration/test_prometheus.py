"""monitoring/ against Debian's Prometheus (installed by `bin/services up`): promtool checks the alert rules and
runs their unit tests; a real Prometheus, started here on a free port with its own data in a tmp dir, scrapes a
harvester and a queue consumer in subprocesses, and its OutboxNoLeader alert fires when the harvester stops and
resolves when a harvester leads again."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from outbox.queue import api, app_settings
from outbox.queue.topics import ensure_topics
from tests.support.harness import Process, Replica, replica_env, wait_until
from tests.support.queue_harness import consumer_args, new_prefix, process_env, queue_settings

# Prometheus's rules and scrapes: the same on any PostgreSQL server (not in make test-postgres18)
pytestmark = [pytest.mark.integration, pytest.mark.postgres_agnostic]

ROOT = Path(__file__).resolve().parents[2]
RULES_DIR = ROOT / "monitoring" / "prometheus"
#: Scrapes and rule evaluations this often: the test sees a stopped harvester within seconds.
INTERVAL = "1s"
#: Every alert's `for` in the copy of the rules the test's Prometheus loads (promtool's tests cover the real ones).
TEST_FOR = "2s"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is missing: `bin/services up` installs Debian's prometheus package")
    return path


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_alert_rules_pass_promtool_and_their_unit_tests():
    check = subprocess.run([tool("promtool"), "check", "rules", "outbox-alerts.yml"], cwd=RULES_DIR,
                           capture_output=True, text=True, timeout=60)
    groups = yaml.safe_load((RULES_DIR / "outbox-alerts.yml").read_text())["groups"]
    rules = sum(len(group["rules"]) for group in groups)
    assert check.returncode == 0 and f"SUCCESS: {rules} rules found" in check.stdout, check.stdout + check.stderr
    tests = subprocess.run([tool("promtool"), "test", "rules", "outbox-alerts.test.yml"], cwd=RULES_DIR,
                           capture_output=True, text=True, timeout=120)
    assert tests.returncode == 0 and "SUCCESS" in tests.stdout, tests.stdout + tests.stderr


class Prometheus:
    """A Prometheus server of its own: a free 127.0.0.1 port, its data under `home`; stopped by stop()."""

    def __init__(self, home: Path, targets: dict[str, int]) -> None:
        rules = yaml.safe_load((RULES_DIR / "outbox-alerts.yml").read_text())
        for group in rules["groups"]:
            for rule in group["rules"]:
                rule["for"] = TEST_FOR
        (home / "rules.yml").write_text(yaml.safe_dump(rules))
        (home / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": INTERVAL, "evaluation_interval": INTERVAL, "scrape_timeout": INTERVAL},
            "rule_files": [str(home / "rules.yml")],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                               for job, port in targets.items()]}))
        self.port = free_port()
        self.log_path = home / "prometheus.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [tool("prometheus"), f"--config.file={home / 'prometheus.yml'}", f"--storage.tsdb.path={home / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT)
        wait_until(self.ready, 60, f"Prometheus to be ready on 127.0.0.1:{self.port} (see {self.log_path})")

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as response:
            return response.read()

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"Prometheus exited: {self.log_path.read_text()[-2000:]}")
        try:
            return self.get("/-/ready").startswith(b"Prometheus Server is Ready")
        except OSError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        answer = json.loads(self.get(f"/api/v1/query?query={urllib.parse.quote(expr)}"))
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def firing(self) -> set[str]:
        alerts = json.loads(self.get("/api/v1/alerts"))["data"]["alerts"]
        return {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Any]:
    started: list[Prometheus] = []

    def start(targets: dict[str, int]) -> Prometheus:
        home = tmp_path / "prometheus"
        home.mkdir()
        started.append(Prometheus(home, targets))
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.mark.django_db(transaction=True)
def test_a_real_prometheus_scrapes_a_harvester_and_a_consumer_and_alerts_when_nobody_leads(
        prometheus, database_url, bootstrap_servers, settings, tmp_path):
    prefix = new_prefix()
    settings.OUTBOX = {**settings.OUTBOX, "queues": queue_settings(prefix)}
    ensure_topics(app_settings.queue_config(), 10)
    harvester_port, consumer_port = free_port(), free_port()
    leader_topic = f"test-leader-{uuid.uuid4().hex[:8]}"
    env = replica_env(database_url, bootstrap_servers, leader_topic)
    metrics = ["--metrics-port", str(harvester_port), "--metrics-address", "127.0.0.1", "--heartbeat-timeout", "2"]
    processes: list[Process] = [Replica("prom-a", env, tmp_path, metrics)]
    consumer_env = process_env(database_url, bootstrap_servers, prefix, tmp_path / "events.log")
    processes.append(Process("prom-consumer", "outbox_consume",
                             consumer_args("emails", "--metrics-port", str(consumer_port), "--metrics-address",
                                           "127.0.0.1"), consumer_env, tmp_path))
    try:
        server = prometheus({"outbox": harvester_port, "queue": consumer_port})
        wait_until(processes[0].is_leading, 60, "the harvester to lead")
        api.send("emails", {"to": "someone@example.com"})
        wait_until(lambda: server.query('outbox_leader_state{job="outbox", name="prom-a", state="leader"} == 1'), 30,
                   "Prometheus to scrape the leader")
        for series in ("outbox_records_published_total", "outbox_in_flight_records", "outbox_backlog_records",
                       "outbox_oldest_record_age_seconds", "outbox_held_records", "outbox_parked_records",
                       "outbox_mark_seconds_bucket", "outbox_records_marked_total"):
            found = wait_until(lambda s=series: server.query(f'{s}{{job="outbox"}}'), 30, f"the series {series}")
            assert all(r["metric"]["instance"] == f"127.0.0.1:{harvester_port}" for r in found)
        [received] = wait_until(lambda: server.query('outbox_queue_messages_received_total{queue="emails"} >= 1'), 60,
                                "the consumer's received counter")
        assert received["metric"]["job"] == "queue"
        assert server.query('outbox_queue_consumer_in_progress{job="queue", queue="emails", name="prom-consumer"}')
        # Nothing had been scraped when Prometheus started: OutboxNoHarvester fired, and resolves now.
        wait_until(lambda: not {"OutboxNoLeader", "OutboxNoHarvester"} & server.firing(), 30,
                   "no outbox alert while the harvester leads")

        processes[0].signal(signal.SIGTERM)
        assert processes[0].wait(timeout=60) == 0
        wait_until(lambda: "OutboxNoLeader" in server.firing(), 60, "OutboxNoLeader to fire")
        assert "OutboxNoHarvester" in server.firing()

        processes.append(Replica("prom-b", env, tmp_path, metrics))  # the same target, a new replica
        wait_until(processes[-1].is_leading, 60, "the new harvester to lead")
        wait_until(lambda: not {"OutboxNoLeader", "OutboxNoHarvester"} & server.firing(), 60,
                   "OutboxNoLeader and OutboxNoHarvester to resolve")
        assert server.query('outbox_leader_state{job="outbox", name="prom-b", state="leader"} == 1')
    finally:
        for process in processes:
            if process.process.poll() is None:
                process.signal(signal.SIGTERM)
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
