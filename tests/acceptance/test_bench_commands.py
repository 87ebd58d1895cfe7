"""The benchmark commands as a contributor meets them (docs/benchmarks.md): what they need, said in one line."""

from __future__ import annotations

import pytest

from tests.support.commands import manage

pytestmark = pytest.mark.postgres_agnostic  # the commands' messages


def test_the_many_outboxes_bench_on_a_database_not_migrated_says_to_migrate_it(fresh_database):
    name, url = fresh_database
    done = manage("outbox_many_bench", "--schemas", "1", "--seconds", "0", env={"DATABASE_URL": url})
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [f"CommandError: database {name} has no table outbox or outbox_harvester: migrate it first "
                     "(DATABASE_URL=<its URL> manage.py migrate)"], done.stderr
    assert "outbox:outbox@" not in done.stdout + done.stderr


def test_the_many_outboxes_bench_names_a_database_it_cannot_reach(services):
    done = manage("outbox_many_bench", "--seconds", "0",
                  env={"DATABASE_URL": services.database_url_for("no_such_database_for_the_bench")})
    assert done.returncode == 1
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("CommandError: cannot connect to the database: ") and "no_such_database" in line, line
    assert "outbox:outbox@" not in line
