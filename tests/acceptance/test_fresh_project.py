"""The README's "Using it in your project", as a new user meets it: the package built as a wheel and
installed into a virtualenv of its own, a project made by `django-admin startproject`, the settings the
README names and nothing from this repository's example project, then migrate, stash(), `manage.py
harvest` publishing to Kafka in key order, and the admin's pages (templates and static files come from
the wheel). Catches what the repository's own tests cannot: a file left out of the wheel, a default that
only the example project's settings make work, a setting the README forgets.

Slow: each test runs a new project's commands in processes of their own (startproject, migrate, harvest, its
own pytest run), each importing Django from the wheel."""

from __future__ import annotations

import signal
import subprocess
import textwrap
from pathlib import Path

import psycopg
import pytest

from tests.support.fresh_project import run, user_env
from tests.support.harness import read_topic, wait_until

# the wheel in a new project: the same on any PostgreSQL server (not in make test-postgres18)
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.postgres_agnostic]


def test_a_new_project_with_the_wheel_harvests_as_the_readme_says(wheel_venv, fresh_database, bootstrap_servers,
                                                                   new_topic, tmp_path):
    python, env = wheel_venv, user_env()
    where = run(python, "-c", "import outbox; print(outbox.__file__)", cwd=tmp_path, env=env).stdout.strip()
    assert where.startswith(str(python.parent.parent)), f"outbox imported from {where}, not the wheel's virtualenv"

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


def test_a_new_projects_own_tests_use_the_test_kit_without_kafka(wheel_venv, fresh_database, tmp_path):
    """docs/testing.md, as a new user follows it: their pytest suite (pytest-django) tests a view that stashes, its
    harvest and a queue handler with outbox.testing, no Kafka anywhere; the test of a view that forgot
    transaction.atomic() fails with OutsideTransaction, as the view would fail in production."""
    python, env = wheel_venv, user_env()
    run(python, "-m", "django", "startproject", "mysite", cwd=tmp_path, env=env)
    site = tmp_path / "mysite"
    name, url = fresh_database
    parts = psycopg.conninfo.conninfo_to_dict(url)
    with (site / "mysite" / "settings.py").open("a") as settings:
        settings.write(textwrap.dedent(f"""
            INSTALLED_APPS += ["django.contrib.postgres", "outbox", "outbox.queue"]
            DATABASES = {{"default": {{"ENGINE": "django.db.backends.postgresql", "NAME": {name!r},
                                      "USER": {parts.get('user')!r}, "PASSWORD": {parts.get('password')!r},
                                      "HOST": {parts.get('host')!r}, "PORT": {str(parts.get('port', 5432))!r},
                                      "TEST": {{"NAME": {name + "_test"!r}}}}}}}
            OUTBOX = {{"base_kafka_config": {{"bootstrap.servers": "127.0.0.1:1"}}}}  # never reached
        """))
    (site / "shop.py").write_text(textwrap.dedent("""
        from django.db import transaction
        from django.http import HttpResponse

        from outbox import queue, stash


        def pay(request, order):
            with transaction.atomic():
                stash("orders", key=str(order), value={"order": order, "status": "paid"})
                queue.stash("receipts", {"order": order})
            return HttpResponse("paid")


        def refund(request, order):  # forgot transaction.atomic()
            stash("orders", key=str(order), value={"order": order, "status": "refunded"})
            return HttpResponse("refunded")


        HANDLED = []


        def send_receipt(message):
            HANDLED.append(message.json()["order"])
    """))
    (site / "mysite" / "urls.py").write_text(textwrap.dedent("""
        from django.urls import path

        import shop

        urlpatterns = [path("pay/<int:order>", shop.pay), path("refund/<int:order>", shop.refund)]
    """))
    (site / "pytest.ini").write_text("[pytest]\nDJANGO_SETTINGS_MODULE = mysite.settings\npythonpath = .\n")
    (site / "test_shop.py").write_text(textwrap.dedent("""
        from outbox.testing import assert_stashed, handle_message

        import shop


        def test_paying_stashes_the_payment(client, outbox_stashed):
            with outbox_stashed() as records:
                assert client.get("/pay/42").status_code == 200
            assert_stashed("orders", key="42", value={"order": 42, "status": "paid"}, records=records)


        def test_the_payment_is_published_and_the_receipt_handled(client, outbox_harvest):
            client.get("/pay/7")
            published = outbox_harvest()
            [payment] = [m for m in published if m.topic == "orders"]
            [receipt] = [m for m in published if m.topic != "orders"]
            assert payment.json() == {"order": 7, "status": "paid"}
            handled = handle_message(shop.send_receipt, receipt.json(), queue="receipts")
            assert (handled.outcome, handled.settled, shop.HANDLED) == ("handled", "acked", [7])


        def test_refunding_stashes_the_refund(client, db):
            assert client.get("/refund/42").status_code == 200
    """))
    done = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_shop.py"], cwd=site,
                          env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "2 passed" in output and "1 failed" in output, output
    assert "FAILED test_shop.py::test_refunding_stashes_the_refund" in output, output
    assert "OutsideTransaction: stash() must run inside transaction.atomic()" in output, output


def test_an_installed_audit_without_its_jars_says_how_to_fetch_them_with_the_packaged_pom(wheel_venv, tmp_path):
    """pip installs no bin/services: the audit's one line names the pom the wheel ships, and Maven's command."""
    python, env = wheel_venv, {k: v for k, v in user_env().items() if k != "OUTBOX_SPARK_JARS"}
    done = subprocess.run([python, "-m", "outbox.pipeline", "--bootstrap-servers", "127.0.0.1:1", "--topics", "t",
                           "--out", str(tmp_path / "out")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    pom = run(python, "-c", "from outbox.pipeline import jars; print(jars.POM)", cwd=tmp_path, env=env).stdout.strip()
    assert pom.startswith(str(python.parent.parent)) and pom.endswith("/outbox/pipeline/pom.xml"), pom
    assert "<artifactId>spark-sql-kafka-0-10_2.13</artifactId>" in Path(pom).read_text(), "the wheel ships it"
    assert done.returncode == 2 and "bin/services" not in done.stderr, done.stderr
    assert f"fetch them with Maven (Java 17): `mvn -B -q -f {pom} dependency:copy-dependencies" in done.stderr, \
        done.stderr
