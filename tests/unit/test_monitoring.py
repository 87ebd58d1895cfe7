"""monitoring/: the alert rules and the Grafana dashboard query only metrics the project exports, every
alert has a runbook section in docs/operations.md and a promtool unit test (run by
tests/integration/test_prometheus.py, with the rules against a real Prometheus)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry

from outbox.harvest.config import HarvestConfig
from outbox.harvest.contract import ReplicaState
from outbox.harvest.outboxes import ManyHarvester
from outbox.harvest.shards import ShardedHarvester
from outbox.metrics import HarvesterCollector, PrometheusInstruments
from outbox.queue import metrics as queue_metrics

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "monitoring" / "prometheus" / "outbox-alerts.yml"
RULE_TESTS = ROOT / "monitoring" / "prometheus" / "outbox-alerts.test.yml"
DASHBOARD = ROOT / "monitoring" / "grafana" / "outbox-dashboard.json"
OPERATIONS = ROOT / "docs" / "operations.md"
#: Series Prometheus makes itself, which the rules may use beside the project's.
PROMETHEUS_OWN = {"up"}


def exported_names() -> set[str]:
    """Every series name the harvester, a consumer and a tracker expose, from their own collectors (a labelled
    counter or histogram nobody has used yet has no samples: its names follow from its type)."""
    registry = CollectorRegistry()
    PrometheusInstruments(registry)
    harvester = SimpleNamespace(config=SimpleNamespace(name="r1", table="outbox"), published=1, failed=0,
                                in_flight_records=0, held=[], backlog=0,
                                status=lambda: SimpleNamespace(state=ReplicaState.LEADER),
                                database_statements={"mark": (1, 0.001, 10)})
    registry.register(HarvesterCollector(harvester, parked=lambda: 0, oldest_age=lambda: 0.0,
                                         horizon=lambda: SimpleNamespace(age=0.0, dead_rows=0)))
    # A sharded replica (with no shard yet) adds its group's shards and those it leads.
    sharded = ShardedHarvester(HarvestConfig(dsn="postgresql://localhost/x", name="r2", shards=4))
    registry.register(HarvesterCollector(sharded))
    # A process harvesting several outboxes (none found yet) adds each outbox's engine up and failures.
    many = ManyHarvester(lambda: {}, name="r3")
    registry.register(HarvesterCollector(many))
    families = list(registry.collect())
    queue_metrics.default_instruments()  # the queue's counters and histogram, in the process's default registry
    families += [f for f in REGISTRY.collect() if f.name.startswith("outbox_queue_")]
    snapshot = SimpleNamespace(queues={"q": SimpleNamespace(in_progress=1, oldest_started=0.0)})
    families += list(queue_metrics.tracker_gauges(lambda: snapshot).collect())
    families += list(queue_metrics.consumer_gauges("q", "c", lambda: 0).collect())
    names = set()
    for family in families:
        names |= {sample.name for sample in family.samples}
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}.get(family.type, ("",))
        names |= {family.name + suffix for suffix in suffixes}
    return names


def queried_names(expr: str) -> set[str]:
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    return set(re.findall(r"\b(outbox_\w+|up)\b", without_strings))


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_the_alert_rules_query_only_exported_metrics():
    exported = exported_names() | PROMETHEUS_OWN
    rules = alert_rules()
    assert len(rules) == 14
    for rule in rules:
        assert queried_names(rule["expr"]) <= exported, rule["alert"]
        assert queried_names(rule["expr"]) - PROMETHEUS_OWN, f"{rule['alert']} queries no outbox metric"


def test_the_grafana_dashboard_queries_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_names()
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert len(queries) >= 20
    for query in queries:
        names = queried_names(query)
        assert names and names <= exported, query
    used = set().union(*(queried_names(q) for q in queries))
    base = {re.sub(r"_(bucket|count|sum|total|created)$", "", n) for n in exported}
    shown = {re.sub(r"_(bucket|count|sum|total|created)$", "", n) for n in used}
    assert base - shown == set(), "every exported metric has a panel"


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r["alert"])
def test_every_alert_has_a_runbook_section_and_a_promtool_test(rule):
    url = rule["annotations"]["runbook_url"]
    page, _, anchor = url.partition("#")
    assert page == "docs/operations.md"
    headings = re.findall(r"^#{2,4} (.+)$", OPERATIONS.read_text(), re.M)
    anchors = {re.sub(r"[^a-z0-9 _-]", "", h.lower()).replace(" ", "-") for h in headings}
    assert anchor in anchors, f"docs/operations.md has no section #{anchor}"
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"] if case["alertname"] == rule["alert"]]
    assert any(case["exp_alerts"] for case in cases) and any(not case["exp_alerts"] for case in cases), \
        "a case where it fires and one where it does not"
    assert rule["labels"]["severity"] in {"critical", "warning"}
