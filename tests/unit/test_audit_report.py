"""The audit's report, exit code and jar lookup: plain Python, no Spark."""

from __future__ import annotations

import json

import pytest

from outbox.pipeline import jars, report
from outbox.pipeline.audit import Findings

NO_LATENCY = {"p50": None, "p95": None, "p99": None}


def findings(**overrides) -> Findings:
    values = {
        "topics": {"orders": {"messages": 5, "distinct_ids": 4, "duplicates": 1, "reversals": 0,
                              "without_headers": 0, "latency_ms": {"p50": 3.0, "p95": 9.0, "p99": 9.8}}},
        "latency_ms": {"p50": 3.0, "p95": 9.0, "p99": 9.8},
        "examples": {"duplicates": [], "reversals": [], "without_headers": []},
    }
    return Findings(**{**values, **overrides})


def test_report_has_the_required_keys_and_every_topic(tmp_path):
    built = report.build(findings(), ["orders", "empty"], run={"mode": "batch"})
    assert list(built)[:6] == ["messages", "distinct_ids", "duplicates", "reversals", "missing", "latency_ms"]
    assert (built["messages"], built["distinct_ids"], built["duplicates"], built["missing"]) == (5, 4, 1, 0)
    assert built["topics"]["empty"] == {"messages": 0, "distinct_ids": 0, "duplicates": 0, "reversals": 0,
                                        "without_headers": 0, "latency_ms": NO_LATENCY}
    assert built["ledger"] is None and built["examples"]["missing"] == []
    path = report.write(built, tmp_path / "out")
    assert json.loads(path.read_text()) == built
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["report.json"]  # no temporary file left


@pytest.mark.parametrize(("reversals", "missing", "code"), [(0, 0, 0), (1, 0, 1), (0, 2, 1)])
def test_exit_code_fails_on_reversals_or_missing_only(reversals, missing, code):
    topics = {"t": {"messages": 3, "distinct_ids": 2, "duplicates": 1, "reversals": reversals,
                    "without_headers": 1, "latency_ms": NO_LATENCY}}
    built = report.build(findings(topics=topics, missing=missing, missing_examples=[7] * missing, ledger_ids=9),
                         ["t"], ledger="ids.txt")
    assert report.exit_code(built) == code
    text = report.summary(built, "out/report.json")
    assert text.splitlines()[-2] == ("result: OK" if code == 0 else f"result: FAILED ({reversals} reversals, "
                                                                      f"{missing} missing)")
    assert "(ledger ids.txt: 9 ids)" in text


def test_jars_come_from_the_first_source_given(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    for folder in (first, second):
        folder.mkdir()
        (folder / "spark-sql-kafka-0-10_2.13-4.2.0.jar").touch()
        (folder / "kafka-clients-3.9.2.jar").touch()
    env = {jars.ENV_VAR: str(second)}
    assert jars.resolve(str(first), None, env, default_dir=tmp_path / "none")[0].startswith(str(first))
    assert jars.resolve(None, str(first), env, default_dir=tmp_path / "none")[0].startswith(str(second))
    assert jars.resolve(None, [str(first / "kafka-clients-3.9.2.jar"),
                               str(first / "spark-sql-kafka-0-10_2.13-4.2.0.jar")], {}, default_dir=second) == [
        str(first / "kafka-clients-3.9.2.jar"), str(first / "spark-sql-kafka-0-10_2.13-4.2.0.jar")]
    assert len(jars.resolve(None, None, {}, default_dir=second)) == 2
    assert jars.resolve("hdfs:///libs/spark-sql-kafka-0-10_2.13-4.2.0.jar", None, {}) == [
        "hdfs:///libs/spark-sql-kafka-0-10_2.13-4.2.0.jar"]


@pytest.mark.parametrize(("flag", "message"), [
    (None, "jars were not found"),
    ("/no/such/dir", "does not exist"),
    ("EMPTY", "no *.jar"),
    ("OTHER", "has no spark-sql-kafka-0-10 jar"),
])
def test_missing_jars_say_how_to_fetch_them(tmp_path, flag, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "kafka-clients-3.9.2.jar").touch()
    flag = {"EMPTY": str(tmp_path / "empty"), "OTHER": str(tmp_path / "other")}.get(flag, flag)
    with pytest.raises(jars.JarsNotFound, match="bin/services up") as raised:
        jars.resolve(flag, None, {}, default_dir=tmp_path / "none")
    assert message in str(raised.value)
