"""The README's table of supported versions says what the package declares and CI runs: pyproject's Python and
Django, the engine's oldest Postgres, the Kafka and Spark that bin/services pins."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import django

from outbox.harvest.store import MIN_SERVER_VERSION

ROOT = Path(__file__).resolve().parents[2]


def _table() -> dict[str, list[str]]:
    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 3:
            rows[cells[0]] = cells[1:]
    return rows


#: The poms that pin what the project runs: the broker's (bin/services), the audit's jars (shipped in the package).
POMS = {"kafka": ROOT / "services" / "kafka" / "pom.xml", "spark": ROOT / "outbox" / "pipeline" / "pom.xml"}


def _pinned(pom: str, name: str) -> str:
    text = POMS[pom].read_text()
    return re.search(rf"<{name}>([^<]+)</{name}>", text).group(1)


def test_python_and_django_as_pyproject_declares() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    table = _table()
    pythons = sorted(re.findall(r"Python :: (3\.\d+)$", "\n".join(project["classifiers"]), re.M),
                     key=lambda v: int(v.split(".")[1]))
    assert project["requires-python"] == f">={pythons[0]}"
    assert table["Python"][0] == f"{pythons[0]}-{pythons[-1]}"
    djangos = re.findall(r"Framework :: Django :: (\d\.\d)$", "\n".join(project["classifiers"]), re.M)
    assert f"django>={djangos[0]}" in project["dependencies"]
    assert table["Django"][0] == f"{djangos[0]}-{djangos[-1]}"
    assert table["Django"][1].startswith(".".join(django.__version__.split(".")[:2]))  # the venv CI tests in


def test_postgres_kafka_and_spark_as_the_code_and_bin_services_say() -> None:
    table = _table()
    assert table["PostgreSQL"][0].startswith(f"{MIN_SERVER_VERSION // 10000} or later")
    assert f"on {MIN_SERVER_VERSION // 10000}" in table["PostgreSQL"][1]
    assert table["Kafka"][1] == _pinned("kafka", "kafka.version")
    spark = _pinned("spark", "spark.version")
    assert table["Spark (the audit only)"] == [spark.rsplit(".", 1)[0], spark]
    spark_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["spark"]
    assert f"pyspark[sql]>={spark.rsplit('.', 1)[0]},<" in spark_extra[0]
