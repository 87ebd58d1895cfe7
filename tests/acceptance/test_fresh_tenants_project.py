"""Many outboxes as a django-tenants user meets them: a project made by `django-admin startproject` with
the wheel and django-tenants (one schema per tenant, the outbox app among the tenant apps, so each
tenant's migrations make its outbox table and NOTIFY trigger), OUTBOX["outboxes"] naming the tenant
schemas as docs/scaling.md says, two `manage.py harvest` processes. stash() inside a tenant's
schema_context reaches Kafka in key order; a tenant created while they run is harvested too.

Slow: django-tenants migrates every tenant schema, and two harvesters must discover a tenant made while they
run (their discovery interval)."""

from __future__ import annotations

import signal
import subprocess
import textwrap

import psycopg
import pytest

from tests.support.fresh_project import run, user_env
from tests.support.harness import assert_complete_and_ordered, wait_until
from tests.support.tenants import read_tenants

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TENANT_MODELS = '''
from django.db import models
from django_tenants.models import DomainMixin, TenantMixin


class Client(TenantMixin):
    name = models.CharField(max_length=100)
    auto_create_schema = True


class Domain(DomainMixin):
    pass
'''

ORDER_MODEL = '''
from django.db import models


class Order(models.Model):
    item = models.CharField(max_length=100)
'''


def test_a_django_tenants_project_harvests_every_tenant_schema(wheel_venv, fresh_database,
                                                              bootstrap_servers, new_topic, tmp_path):
    python, env = wheel_venv, user_env()
    run(python, "-m", "django", "startproject", "saas", cwd=tmp_path, env=env)
    site = tmp_path / "saas"
    for app, models in (("customers", TENANT_MODELS), ("shop", ORDER_MODEL)):
        run(python, "manage.py", "startapp", app, cwd=site, env=env)
        (site / app / "models.py").write_text(models)
    name, url = fresh_database
    parts = psycopg.conninfo.conninfo_to_dict(url)
    settings = (site / "saas" / "settings.py").read_text()
    settings = settings.replace("INSTALLED_APPS = [", "SHARED_APPS = [\n    'django_tenants',\n    'customers',\n"
                                "    'django.contrib.postgres',\n    'outbox',", 1)
    settings = settings.replace("MIDDLEWARE = [",
                                "MIDDLEWARE = [\n    'django_tenants.middleware.main.TenantMainMiddleware',", 1)
    settings += textwrap.dedent(f"""
        TENANT_APPS = ["django.contrib.contenttypes", "django.contrib.postgres", "outbox", "shop"]
        INSTALLED_APPS = list(SHARED_APPS) + [app for app in TENANT_APPS if app not in SHARED_APPS]
        TENANT_MODEL = "customers.Client"
        TENANT_DOMAIN_MODEL = "customers.Domain"
        DATABASE_ROUTERS = ["django_tenants.routers.TenantSyncRouter"]
        DATABASES = {{"default": {{"ENGINE": "django_tenants.postgresql_backend", "NAME": {name!r},
                                  "USER": {parts.get('user')!r}, "PASSWORD": {parts.get('password')!r},
                                  "HOST": {parts.get('host')!r}, "PORT": {str(parts.get('port', 5432))!r}}}}}
        OUTBOX = {{
            "base_kafka_config": {{"bootstrap.servers": {bootstrap_servers!r}}},
            "outboxes": {{"tenants": {{"tenant_schemas": True, "exclude_schemas": ["public"]}}}},
            "discover_interval": 2,
        }}
    """)
    (site / "saas" / "settings.py").write_text(settings)

    def manage(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return run(python, "manage.py", *args, cwd=site, env=env, timeout=timeout)

    def script(path: str, *args: str) -> str:
        """A script of the project's run by `manage.py shell`, with `args` as its sys.argv[1:]."""
        return manage("shell", "-c", f"import sys; sys.argv = ['x', *{list(args)!r}]; exec(open({path!r}).read())"
                      ).stdout

    manage("makemigrations", "customers", "shop")
    assert "no issues" in manage("check").stdout
    manage("migrate_schemas", "--shared")
    create = textwrap.dedent("""
        import sys
        from customers.models import Client, Domain
        for schema in sys.argv[1:]:
            tenant = Client(schema_name=schema, name=schema)
            tenant.save()
            Domain(domain=f"{schema}.localhost", tenant=tenant, is_primary=True).save()
    """)
    (site / "create_tenants.py").write_text(create)
    script("create_tenants.py", "public", "acme", "globex")

    topic = new_topic("fresh-tenants", partitions=3)
    stash = textwrap.dedent(f"""
        import sys
        from django.db import transaction
        from django_tenants.utils import schema_context
        from outbox import stash
        from shop.models import Order
        for schema in sys.argv[1:]:
            with schema_context(schema):
                for i in range(12):
                    with transaction.atomic():
                        order = Order.objects.create(item=f"item-{{i}}")
                        print("stashed", schema, stash({topic!r}, key=f"{{schema}}-key-{{i % 3}}",
                                                       value={{"order": order.pk}}))
    """)
    (site / "stash_orders.py").write_text(stash)

    def stash_in(*schemas: str) -> dict[str, list[int]]:
        out = script("stash_orders.py", *schemas)
        found: dict[str, list[int]] = {schema: [] for schema in schemas}
        for line in out.splitlines():
            if line.startswith("stashed "):
                _, schema, record_id = line.split()
                found[schema].append(int(record_id))
        return found

    logs = [tmp_path / f"harvest-{i}.log" for i in range(2)]
    harvesters = []
    for i, log in enumerate(logs):
        with log.open("w") as out:
            harvesters.append(subprocess.Popen([str(python), "manage.py", "harvest", "--name", f"tenants-{i}"],
                                               cwd=site, env=env, stdout=out, stderr=subprocess.STDOUT))
    try:
        def leading() -> set[str]:
            assert all(h.poll() is None for h in harvesters), "\n".join(log.read_text() for log in logs)
            with psycopg.connect(url) as conn:
                return {row[0] for row in conn.execute(
                    "SELECT harvested_table FROM public.outbox_harvester WHERE state = 'leader'").fetchall()}

        wait_until(lambda: leading() == {"acme.outbox", "globex.outbox"}, 120, "a leader for each tenant's outbox")
        written = stash_in("acme", "globex")
        # A tenant signed up while the harvesters run: its schema and outbox are found within discover_interval.
        script("create_tenants.py", "initech")
        wait_until(lambda: "initech.outbox" in leading(), 120, "a leader for the new tenant's outbox")
        written |= stash_in("initech")
        audits = read_tenants(bootstrap_servers, topic, written, timeout=120)
        assert sorted(audits) == ["acme", "globex", "initech"]
        for schema, ids in written.items():
            assert len(ids) == 12
            assert_complete_and_ordered(audits[schema], ids)
    finally:
        for harvester in harvesters:
            harvester.send_signal(signal.SIGTERM)
        codes = []
        for harvester in harvesters:
            try:
                codes.append(harvester.wait(timeout=60))
            except subprocess.TimeoutExpired:
                harvester.kill()  # never leave a harvester behind the test
                codes.append(harvester.wait())
    logged = "\n".join(log.read_text() for log in logs)
    assert codes == [0, 0], logged
    assert "Traceback" not in logged, logged

