"""What the outbox costs the database, in a real browser: a real harvester drains records against the real
Postgres (with pg_stat_statements), and the dashboard's section shows the server's time and the round trips by
kind of statement. Headless Debian Chromium via Playwright; the screenshot goes to .artifacts/screenshots/."""

from __future__ import annotations

import contextlib
import time
import uuid
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.db import connections, transaction
from django.utils import timezone

from outbox import stash_many
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.harvester import Harvester
from outbox.models import HarvesterSample, OutboxRecord
from tests.browser.conftest import SCREENSHOTS
from tests.support.harness import wait_until

# What statements cost is the server's (pg_stat_statements, the server's CPU): other workers' harvesters would count.
pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.serial,
              pytest.mark.django_db(transaction=True)]

#: The dashboard's default span reads 20-second buckets: the run's samples are spread this far apart
#: (their order and figures kept) so that its charts have lines to draw.
SPREAD = 30.0


class RolledBack(Exception):
    pass


def test_the_dashboard_shows_what_harvesting_cost_the_database_by_statement(
        live_server, browser, statement_stats, bootstrap_servers, new_topic, monkeypatch):
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API runs an event loop
    topic = new_topic("cost-browser")
    group = f"test-leader-{uuid.uuid4().hex[:8]}"
    config = HarvestConfig(dsn=statement_stats, base_kafka_config={"bootstrap.servers": bootstrap_servers},
                           leader_topic=group, leader_group=group, name="cost-browser", history_retention=86400,
                           limits=Limits(heartbeat_timeout=2.0, status_interval=0.1, history_interval=0.3))
    harvester = Harvester(config)
    harvester.start()
    written = 0
    try:
        wait_until(lambda: harvester.is_leader, 30, "the harvester to lead")
        for batch in range(8):  # a steady writer: a sample between batches
            if batch == 1:
                # An id taken and rolled back: a gap the next mark looks up, reading the outbox's writers (a mark
                # without gaps does not read them, and a fresh test database's ids start at 1 without one).
                with contextlib.suppress(RolledBack), transaction.atomic():
                    stash_many([{"topic": topic, "key": "gone", "value": "rolled back"}])
                    raise RolledBack
            with transaction.atomic():
                written += len(stash_many([{"topic": topic, "key": f"k{i % 13}", "value": f"{batch}:{i}"}
                                           for i in range(250)]))
            time.sleep(0.5)
        wait_until(lambda: not OutboxRecord.objects.exists(), 30, "the outbox to be drained")
        # The gap's lookup ran after the leader first read pg_stat_statements' texts: it reads them again 10 s on.
        wait_until(lambda: HarvesterSample.objects.filter(name="cost-browser", published=written,
                                                          db_statements__has_key="writers").exists(),
                   40, "a sample with every record published and the server's time, the writers' read included")
    finally:
        harvester.stop()
        harvester.wait(timeout=30)
    kept = list(HarvesterSample.objects.filter(name="cost-browser").order_by("at"))
    now = timezone.now()
    for i, sample in enumerate(kept):
        sample.at = now - timedelta(seconds=SPREAD * (len(kept) - 1 - i))
        sample.since = kept[0].at - timedelta(seconds=1)
    HarvesterSample.objects.bulk_update(kept, ["at", "since"])

    User.objects.create_superuser("operator", "op@example.com", "s3cret-pw")
    # Playwright's loop makes this thread's ORM connections its own: closed here, or the test database stays in use.
    connections.close_all()
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.goto(f"{live_server.url}/admin/outbox/dashboard/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", "s3cret-pw")
    page.click("input[type=submit]")
    page.wait_for_url("**/admin/outbox/dashboard/")
    section = page.locator("#database-cost")
    summary = section.locator("#database-cost-summary").inner_text()
    assert f"the harvesters published {written:,} records; the database spent" in summary, summary
    titles = section.locator("figure[data-title]").evaluate_all("figures => figures.map(f => f.dataset.title)")
    assert titles == ["Database time by statement", "Round trips by statement, time waited"]
    assert section.locator("figure[data-title='Database time by statement'] .chart-line").count() >= 3
    kinds = section.locator("tr.cost-kind").evaluate_all("rows => rows.map(r => r.dataset.kind)")
    assert {"mark", "writers", "purge", "status"} <= set(kinds), kinds
    purge = section.locator("tr.cost-kind[data-kind='purge'] td").all_inner_texts()
    assert purge[1].strip() and purge[1].strip() != "0", f"the purges' database time is shown: {purge}"
    section.scroll_into_view_if_needed()
    section.screenshot(path=SCREENSHOTS / "dashboard-database-cost.png")
    page.close()
