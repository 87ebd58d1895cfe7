"""The operator's console in a real browser: the dashboard's charts in light and dark mode, auto-refresh that
keeps what the operator ticked, and the queue pages laid out as the other admin pages (breadcrumbs in the
header bar). Screenshots carry the Django version in their names (run under 5.2 and 6.x, see README)."""

from __future__ import annotations

import math
import re
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import django
import pytest
from django.contrib.auth.models import User
from django.db import connections
from django.utils import timezone

from outbox.harvest.contract import ReplicaState
from outbox.models import OutboxRecord
from outbox.queue.models import DeadLetter, QueueCounter, QueueProcess, QueueSample
from tests.support.harness import wait_until
from tests.support.history_rows import samples
from tests.support.screenshots import SCREENSHOTS
from tests.support.status_rows import held_record, status_row

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.django_db(transaction=True)]

VERSION = f"django{django.VERSION[0]}.{django.VERSION[1]}"
#: The admin's --breadcrumbs-bg in its light theme (the header bar's blue under the title).
BREADCRUMBS_BACKGROUND = "rgb(38, 75, 93)"


def shot(page: Any, name: str) -> None:
    page.screenshot(path=SCREENSHOTS / f"{name}-{VERSION}.png", full_page=True)


def login(page: Any, url: str) -> None:
    page.goto(url)
    assert "/admin/login/" in page.url, "a stranger is sent to the login page"
    page.fill("#id_username", "operator")
    page.fill("#id_password", "s3cret-pw")
    page.click("input[type=submit]")
    page.wait_for_url(re.compile(re.escape(url)))


def breadcrumbs_in_the_header_bar(page: Any) -> None:
    """Styled as the admin's own pages: the bar's background, full width, right under the header."""
    crumbs = page.locator(".breadcrumbs")
    assert crumbs.count() == 1
    assert crumbs.evaluate("e => getComputedStyle(e).backgroundColor") == BREADCRUMBS_BACKGROUND
    header = page.locator("#header").bounding_box()
    box = crumbs.bounding_box()
    assert abs(box["y"] - (header["y"] + header["height"])) <= 1 and box["x"] == 0


def an_hour_of_history() -> None:
    """replica-a led until half an hour ago, replica-b since; a little backlog across three topics."""
    now = timezone.now()
    samples("replica-a", minutes=30, leading_from=40, rate=900.0, failed_rate=2.0, backlog=1200, oldest_age=4.0,
            now=now - timedelta(minutes=30))
    samples("replica-b", minutes=60, leading_from=30, rate=1400.0, backlog=300, oldest_age=1.5, now=now)


def test_the_dashboard_charts_refresh_without_losing_the_operators_selection(live_server, browser, monkeypatch):
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API runs an event loop
    User.objects.create_superuser("operator", "op@example.com", "s3cret-pw")
    an_hour_of_history()
    leader_id = uuid.uuid4()
    for i in range(30):
        OutboxRecord.objects.create(kafka_topic=("orders", "emails", "audit")[i % 3], kafka_key=f"k{i}",
                                    kafka_value="v", leader_id=leader_id if i < 6 else None)
    bad = OutboxRecord.objects.create(kafka_topic="orders", kafka_key="order-poison", kafka_value="x" * 2000,
                                      leader_id=leader_id, reset_count=1, last_error="Broker: Message size too large")
    status_row("replica-b", ReplicaState.LEADER, leader_id=leader_id, in_flight_keys=["k0", "k1"],
               held=[held_record(bad.id, "order-poison")], throughput=1400.0)
    status_row("replica-a")

    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    dashboard = f"{live_server.url}/admin/outbox/dashboard/"
    login(page, dashboard)
    assert page.locator("svg.outbox-chart").count() == 5
    assert page.locator("svg.outbox-chart polyline").count() >= 8
    assert "replica-b took the lead at" in page.locator("#takeovers").inner_text()
    breadcrumbs_in_the_header_bar(page)
    light = page.locator("svg.outbox-chart .chart-line.chart-1").first.evaluate("e => getComputedStyle(e).stroke")
    shot(page, "dashboard")
    page.locator("#charts").screenshot(path=SCREENSHOTS / f"dashboard-charts-{VERSION}.png")

    page.emulate_media(color_scheme="dark")
    page.reload()
    dark = page.locator("svg.outbox-chart .chart-line.chart-1").first.evaluate("e => getComputedStyle(e).stroke")
    assert dark != light, "the lines take the dark theme's colours"
    assert page.locator("svg.outbox-chart .chart-axis").first.evaluate("e => getComputedStyle(e).fill") != \
        "rgb(0, 0, 0)", "axis labels stay readable on the dark background"
    page.locator("#charts").screenshot(path=SCREENSHOTS / f"dashboard-charts-dark-{VERSION}.png")
    page.emulate_media(color_scheme="light")
    page.reload()

    # Auto-refresh: off by default; on, the page's parts are replaced in place, keeping what was ticked.
    assert page.locator("#outbox-refresh").input_value() == "0"
    page.locator("tr.held-record input.held-select").check()
    page.evaluate("window.outboxNotReloaded = true")
    page.select_option("#outbox-refresh", "5")
    assert "refresh=5" in page.url
    assert page.locator("input[name=next]").first.input_value().endswith("refresh=5")
    status_row("replica-c", host="host-c")
    OutboxRecord.objects.create(kafka_topic="invoices", kafka_key="i-1", kafka_value="v")
    wait_until(lambda: "replica-c" in page.locator("#replicas").inner_text(), 30,
               "the new replica to appear without a reload", interval=0.5)
    assert "invoices" in page.locator("#topics").inner_text()
    assert page.evaluate("window.outboxNotReloaded === true"), "the page was updated in place, not reloaded"
    assert page.locator("tr.held-record input.held-select").is_checked(), "the operator's tick survived"
    assert page.locator("#outbox-refresh").input_value() == "5"
    shot(page, "dashboard-refreshed")
    page.reload()
    assert page.locator("#outbox-refresh").input_value() == "5", "a reload keeps the interval"
    page.close()
    connections.close_all()


def test_the_replicas_table_tells_a_clean_stop_from_a_replica_gone(live_server, browser, monkeypatch):
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API runs an event loop
    User.objects.create_superuser("operator", "op@example.com", "s3cret-pw")
    status_row("replica-b", ReplicaState.LEADER, leader_id=uuid.uuid4(), throughput=1400.0)
    status_row("replica-crashed", ReplicaState.STANDBY, seen=600)
    status_row("replica-stopped", ReplicaState.STOPPED, seen=120, host="host-c")
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    login(page, f"{live_server.url}/admin/outbox/dashboard/")
    rows = {row.locator("td").first.inner_text(): row.locator("td").nth(1).inner_text()
            for row in page.locator("#replicas tbody tr").all()}
    assert rows == {"replica-b": "leader", "replica-crashed": "gone (was standby)",
                    "replica-stopped": "stopped cleanly"}
    page.locator("#replicas").screenshot(path=SCREENSHOTS / f"dashboard-replicas-stopped-{VERSION}.png")
    page.close()
    connections.close_all()


def test_the_queue_pages_have_the_admins_layout_and_charts(live_server, browser, monkeypatch):
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    User.objects.create_superuser("operator", "op@example.com", "s3cret-pw")
    now = timezone.now()
    started = (datetime.now(UTC) - timedelta(minutes=4)).timestamp()
    QueueProcess.objects.create(name="tracker-1", kind="tracker", host="host-a", pid=7,
                                started=now - timedelta(hours=1), last_seen=now, in_progress=5, stats={
                                    "partitions": [0, 1, 2, 3], "replaying": [],
                                    "queues": {"emails": {"in_progress": 5, "oldest_started": started}},
                                    "markers": {"emails": {"starts": 900, "ends": 895}}})
    QueueProcess.objects.create(name="emails-1", kind="consumer", queue="emails", host="host-b", pid=8,
                                started=now - timedelta(hours=1), last_seen=now, in_progress=5,
                                stats={"handler": "shop.handlers.send", "workers": 4, "received": 900, "acked": 895})
    QueueCounter.objects.create(queue="emails", redelivered=42, dead_lettered=2)
    DeadLetter.objects.create(queue="emails", message_id="m-1", payload=b'{"to": "x"}', deliveries=5,
                              last_delivered=now)
    count = 360
    QueueSample.objects.bulk_create([
        QueueSample(at=now - timedelta(seconds=(count - 1 - i) * 10), process="tracker-1", queue=queue,
                    in_progress=round((6 + 4 * math.sin(i / 25)) * scale), redelivered=i * scale // 3,
                    dead_lettered=i // 150)
        for i in range(count) for queue, scale in (("emails", 1), ("reports", 2))])

    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    queues = f"{live_server.url}/admin/outbox_queue/queue/"
    login(page, queues)
    breadcrumbs_in_the_header_bar(page)
    assert page.locator("svg.outbox-chart").count() == 3
    assert page.locator(".chart-legend").first.locator("li").all_inner_texts() == ["emails", "reports"]
    shot(page, "queues")
    page.click("a.queue-name:has-text('emails')")
    page.wait_for_url("**/admin/outbox_queue/queue/emails/")
    breadcrumbs_in_the_header_bar(page)
    assert page.locator("svg.outbox-chart").count() == 2
    assert page.locator("svg.outbox-chart polyline").count() == 3
    shot(page, "queue")
    page.close()
    connections.close_all()
