"""The README's "Using it in your project", as a new user meets it: the package built as a wheel and
installed into a virtualenv of its own, a project made by `django-admin startproject`, the settings the
README names and nothing from this repository's example project, then migrate, stash(), `manage.py
harvest` publishing to Kafka in key order, and the admin's pages (templates and static files come from
the wheel). Catches what the repository's own tests cannot: a file left out of the wheel, a default that
only the example project's settings make work, a setting the README forgets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
import textwrap
import uuid
from pathlib import Path

import psycopg
import pytest

from tests.support.harness import read_topic, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done


@pytest.fixture
def fresh_database(services):
    """A database of its own on the tests' server, as a new project would have."""
    name = f"fresh_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(services.database_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield name, services.database_url_for(name)
    with psycopg.connect(services.database_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def wheel_venv(tmp_path: Path) -> Path:
    """The wheel `pip wheel --no-deps -w dist .` builds (the README's command), installed with no
    dependencies into a new virtualenv; the dependencies come from this interpreter's site-packages (a
    .pth file), so nothing is fetched, and the package itself only from the wheel."""
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, ROOT)
    [wheel] = dist.glob("django_outbox_harvest-*.whl")
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(purelib, "dependencies.pth").write_text("".join(f"{path}\n" for path in sorted(ours)))
    run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel)
    return python


def user_env() -> dict[str, str]:
    """The environment of a user's shell: none of the tests' settings module or paths."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"DJANGO_SETTINGS_MODULE", "PYTHONPATH", "DATABASE_URL", "OUTBOX_LEADER_TOPIC",
                        "OUTBOX_LEADER_GROUP"}}
    return {**env, "PYTHONUNBUFFERED": "1"}


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
