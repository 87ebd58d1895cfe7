"""The README's "Using it in your project", as a new user meets it: the package built as a wheel and
installed into a virtualenv of its own, a project made by `django-admin startproject`, the settings the
README names and nothing from this repository's example project, then migrate, stash(), `manage.py
harvest` publishing to Kafka in key order, and the admin's pages (templates and static files come from
the wheel). Catches what the repository's own tests cannot: a file left out of the wheel, a default that
only the example project's settings make work, a setting the README forgets."""

from __future__ import annotations

import signal
import subprocess
import textwrap

import psycopg
import pytest

from tests.support.fresh_project import run, user_env
from tests.support.harness import read_topic, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_new_project_with_the_wheel_harvests_as_the_readme_says(wheel_venv, fresh_database, bootstrap_servers,
                                                                   new_topic, tmp_path):
    python, env = wheel_venv, user_env()
    where = run(python, "-c", "import outbox; print(outbox.__file__)", cwd=tmp_path, env=env).stdout.strip()
    assert where.startswith(str(tmp_path / "venv")), f"outbox imported from {where}, not the wheel"

    run(python, "-m", "django", "startproject", "mysite", cwd=tmp_path, env=env)
    site = tmp_path / "mysite"
    name, url = fresh_database
    parts = psycopg.conninfo.conninfo_to_dict(url)
    with (site / "mysite" / "settings.py").open("a") as settings:  # what the README tells a user to add
        settings.write(textwrap.dedent(f"""
            INSTALLED_APPS += ["django.contrib.postgres", "outbox"]
            DATABASES = {{"default": {{"ENGINE": "django.db.backends.postgresql", "NAME": {name!r},
                                      "USER": {parts.get('user')!r}, "PASSWORD": {parts.get('password')!r},
                                      "HOST": {parts.get('host')!r}, "PORT": {str(parts.get('port', 5432))!r}}}}}
            OUTBOX = {{"base_kafka_config": {{"bootstrap.servers": {bootstrap_servers!r}}}}}
        """))

    def manage(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return run(python, "manage.py", *args, cwd=site, env=env, timeout=timeout)

    assert "no issues" in manage("check").stdout
    manage("migrate", "--noinput")
    topic = new_topic("fresh-project", partitions=2)
    stashed = manage("shell", "-c", textwrap.dedent(f"""
        from django.db import transaction
        from outbox import stash
        with transaction.atomic():
            for i in range(20):
                print("stashed", stash({topic!r}, key=f"k{{i % 3}}", value={{"n": i}}))
    """)).stdout.splitlines()
    ids = [int(line.split()[1]) for line in stashed if line.startswith("stashed ")]
    assert len(ids) == 20

    with (tmp_path / "harvest.log").open("w") as log:
        harvest = subprocess.Popen([str(python), "manage.py", "harvest"], cwd=site, env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
    try:
        def rows() -> int:
            with psycopg.connect(url) as conn:
                return conn.execute("SELECT count(*) FROM outbox").fetchone()[0]

        wait_until(lambda: rows() == 0 or harvest.poll() is not None, 120, "the harvester to drain the outbox")
        assert harvest.poll() is None, (tmp_path / "harvest.log").read_text()
    finally:
        harvest.send_signal(signal.SIGTERM)
        code = harvest.wait(timeout=60)
    logged = (tmp_path / "harvest.log").read_text()
    assert code == 0, logged
    assert "Leading with leader id" in logged and "Traceback" not in logged, logged
    audit = read_topic(bootstrap_servers, topic, expected=20)
    assert sorted(id for key in audit.by_key for id in audit.by_key[key]) == ids
    for key, got in audit.by_key.items():
        assert got == sorted(got), f"key {key} out of order: {got}"

    pages = manage("shell", "-c", textwrap.dedent("""
        from django.conf import settings
        from django.contrib.auth.models import User
        from django.contrib.staticfiles import finders
        from django.test import Client
        settings.ALLOWED_HOSTS = ["testserver"]
        client = Client()
        client.force_login(User.objects.create_superuser("admin", "admin@example.com", "unused"))
        for url in ["/admin/", "/admin/outbox/outboxrecord/", "/admin/outbox/deadletter/"]:
            print(url, client.get(url, follow=True).status_code)
        print("static", bool(finders.find("outbox/refresh.js")))
    """)).stdout
    answers = [line for line in pages.splitlines() if line.startswith(("/", "static"))]
    assert answers == ["/admin/ 200", "/admin/outbox/outboxrecord/ 200", "/admin/outbox/deadletter/ 200",
                       "static True"], pages
