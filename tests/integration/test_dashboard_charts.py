"""The dashboard's charts, the backlog by topic and the console's choices, through Django's test client.
History samples are written as a replica's status reporter writes them (tests/support/history_rows.py)."""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import User
from django.db import connections
from django.test import Client
from django.utils import timezone

from outbox.console import history
from outbox.console.charts import clock
from outbox.harvest.contract import ReplicaState
from outbox.models import HarvesterSample, OutboxRecord
from outbox.states import table_estimate
from tests.support.harness import wait_until
from tests.support.history_rows import samples
from tests.support.status_rows import status_row

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

DASHBOARD = "/admin/outbox/dashboard/"


@pytest.fixture
def client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", None))
    return client


def figure(page: str, title: str) -> str:
    found = re.search(rf'<figure class="outbox-chart-figure" data-title="{re.escape(title)}">(.*?)</figure>', page,
                      re.S)
    assert found, f"no chart {title!r}"
    return found.group(1)


def test_the_charts_draw_each_replicas_rates_the_backlog_and_mark_the_moment_the_lead_moved(client):
    now = timezone.now()
    # replica-a leads from 50 to 30 minutes ago, then replica-b takes over.
    samples("replica-a", leading_from=20, rate=100.0, failed_rate=0.5, now=now - timedelta(minutes=30), minutes=30)
    samples("replica-b", leading_from=30, rate=250.0, now=now)
    status_row("replica-b", ReplicaState.LEADER, leader_id=HarvesterSample.objects.filter(
        name="replica-b", state="leader").first().leader_id)
    page = client.get(DASHBOARD).content.decode()
    titles = re.findall(r'data-title="([^"]+)"', page)
    assert titles == ["Records published per second", "Deliveries failed per second", "Rows in the outbox",
                      "Age of the oldest row", "Records in flight",
                      "Round trips by statement, time waited"]  # what the database paid: no figures here
    published = figure(page, "Records published per second")
    assert "replica-a: 100/s" in published and "replica-b: 250/s" in published
    assert published.count('class="chart-line chart-1"') >= 1 and published.count('class="chart-line chart-2"') >= 1
    assert "replica-a: 0.5/s" in figure(page, "Deliveries failed per second")
    assert "outbox: 500 at" in figure(page, "Rows in the outbox")
    assert "outbox: 30 s at" in figure(page, "Age of the oldest row")
    for name in ("replica-a", "replica-b"):
        took = HarvesterSample.objects.filter(name=name, state="leader").first().since
        assert f"{name} took the lead at {clock(took.timestamp())}" in page
    assert page.count('class="chart-marker"') == 6 * 2, "both takeovers on every chart"


def test_a_replica_gone_for_a_while_leaves_a_gap_and_a_restart_is_no_negative_rate(client):
    now = timezone.now()
    samples("replica-a", leading_from=60, minutes=20, now=now - timedelta(minutes=40))
    samples("replica-a", leading_from=20, minutes=20, now=now)  # back after 20 minutes, its totals from zero
    chart = figure(client.get(DASHBOARD).content.decode(), "Records published per second")
    assert chart.count("<polyline") == 2, "two stretches, no line across the gap"
    assert "-" not in "".join(re.findall(r": ([^<]*)/s at", chart)), "no negative rate"


def test_records_of_replicas_whose_samples_all_fall_in_one_bucket_are_counted(client):
    """Two replicas, each sampled twice in one 20-second bucket of the hour (0 then 1 record published): the summary
    counts both records, though neither replica has a bucket before its only one."""
    bucket = 20.0  # an hour in history.MAX_POINTS buckets
    aligned = math.floor(timezone.now().timestamp() / bucket) * bucket
    for name, ends in (("replica-a", aligned - 13), ("replica-b", aligned - bucket - 13)):
        samples(name, minutes=10 / 60, every=5, rate=0.2, leading_from=1,
                now=datetime.fromtimestamp(ends, tz=UTC))
    assert "the harvesters published 2 records" in client.get(DASHBOARD).content.decode()


def test_a_longer_span_is_read_into_a_bounded_number_of_points(client):
    now = timezone.now()
    samples("replica-a", leading_from=24 * 60, minutes=6 * 60, every=10, now=now)  # 2,160 samples, 10 s apart
    for span, bucket in (("1h", 20), ("6h", 120)):
        found = history.read(span, "default", now=now)
        [series] = found.charts[0].series
        assert len(series.points) <= history.MAX_POINTS
        assert len(series.points) >= history.SPANS[span].total_seconds() / bucket - 3
    page = client.get(f"{DASHBOARD}?span=6h").content.decode()
    assert "The last 6 hours" in page and "<strong>last 6 hours</strong>" in page
    assert "The last hour" in client.get(f"{DASHBOARD}?span=bogus").content.decode()


def test_no_history_says_so(client):
    page = client.get(DASHBOARD).content.decode()
    assert page.count("no samples in this span") == 6 and "The lead did not move in this span." in page


def test_the_backlog_by_topic_is_exact_on_a_small_outbox(client):
    for topic, n in (("orders", 3), ("emails", 1)):
        OutboxRecord.objects.bulk_create([OutboxRecord(kafka_topic=topic, kafka_key=f"k{i}") for i in range(n)])
    page = client.get(DASHBOARD).content.decode()
    rows = re.findall(r'<tr class="topic-row"><td>([^<]*)</td><td class="number">(\d+)</td><td>', page)
    assert rows == [("orders", "3"), ("emails", "1")]
    assert "estimate" not in page.split('id="topics"')[1].split('id="held"')[0]


@pytest.mark.django_db(transaction=True)  # committed, so Postgres's statistics see the rows
def test_the_backlog_by_topic_stays_bounded_on_a_big_outbox(client):
    table = OutboxRecord._meta.db_table
    with connections["default"].cursor() as cursor:
        cursor.execute(f"""INSERT INTO "{table}" (kafka_topic, kafka_key, kafka_value)
                           SELECT CASE WHEN g <= 5000 THEN 'head' ELSE 'tail-' || (g % 2) END, 'k' || g, 'v'
                           FROM generate_series(1, 30000) AS g""")
        cursor.execute(f'ANALYZE "{table}"')
    wait_until(lambda: (table_estimate(table) or 0) > 20_000, 10, "Postgres's live-row estimate of the outbox")
    page = client.get(DASHBOARD).content.decode()
    section = page.split('id="topics"')[1].split('id="held"')[0]
    rows = dict(re.findall(r'<tr class="topic-row"><td>([^<]*)</td><td class="number">(\d+)</td>', section))
    assert rows == {"head": "5000", "tail-0": "2500", "tail-1": "2500"}, "counted among the oldest 10,000 rows"
    assert "among the oldest 10000" in section
    estimates = [int(n.replace(",", "")) for n in re.findall(r"about ([\d,]+)", section)]
    assert len(estimates) == 3 and 25_000 <= sum(estimates) <= 35_000


def test_the_refresh_choice_is_kept_in_the_address_and_offered(client):
    page = client.get(f"{DASHBOARD}?refresh=5&span=6h").content.decode()
    assert '<option value="5" selected>every 5 s</option>' in page
    assert 'href="?span=1h&amp;refresh=5"' in page
    assert "outbox/refresh.js" in page
    assert '<option value="0" selected>off</option>' in client.get(f"{DASHBOARD}?refresh=7").content.decode()
    for part in ("warnings", "charts", "leader", "backlog", "topics", "held", "in-flight-keys", "replicas", "stuck"):
        assert f'id="{part}" data-refresh' in page, part


def test_a_young_system_is_charted_from_its_first_sample_and_says_so(client):
    now = timezone.now()
    samples("replica-a", leading_from=5, minutes=5, now=now)  # five minutes old, in an hour's charts
    page = client.get(DASHBOARD).content.decode()
    first = HarvesterSample.objects.order_by("at").first().at
    assert f"The first sample of this span is from {clock(first.timestamp())}: the charts start there." in page
    found = history.read("1h", "default", now=now)
    assert all(now.timestamp() - 7 * 60 < chart.start < first.timestamp() for chart in found.charts)
    assert page.count("the charts start there") == 1, "said once, above the charts"


def test_replicas_not_running_are_one_line_and_one_row(client):
    now = timezone.now()
    for i in range(5):  # five replicas restarted one after another, each under a new generated name
        name = f"vm_{i}"
        samples(name, leading_from=10, minutes=10, rate=10.0, now=now - timedelta(minutes=10 * (5 - i)))
        status_row(name, ReplicaState.STOPPED, seen=600 * (5 - i))
    samples("replica-now", leading_from=10, minutes=10, rate=50.0, now=now)
    status_row("replica-now", ReplicaState.LEADER, leader_id=HarvesterSample.objects.filter(
        name="replica-now", state="leader").first().leader_id)
    page = client.get(DASHBOARD).content.decode()
    published = figure(page, "Records published per second")
    legend = re.findall(r'<li class="chart-\d+">([^<]*)</li>', published)
    assert legend == ["replica-now", "5 replicas not running now"]
    assert "5 replicas not running now (one line, summed): vm_0, vm_1, vm_2, vm_3, vm_4." in published
    assert "5 replicas not running now: 10/s" in published, "the stopped replicas' rate, summed per bucket"
    replicas = page.split('id="replicas"')[1].split('id="stuck"')[0]
    assert "<summary>5 replicas stopped cleanly</summary>" in replicas
    assert replicas.count("<tr") == 3, "the header, the leader, and one row for the five stopped"


def test_lead_changes_close_together_are_one_mark_that_counts_them(client):
    now = timezone.now()
    for i, name in enumerate(("a", "b", "a2")):  # three takeovers within 20 s, then one 30 minutes later
        samples(name, leading_from=1, minutes=1, now=now - timedelta(minutes=40) + timedelta(seconds=10 * i))
    samples("c", leading_from=10, minutes=10, now=now)
    page = client.get(DASHBOARD).content.decode()
    marks = re.findall(r'<line class="chart-marker"[^>]*><title>([^<]*)</title>', figure(page, "Rows in the outbox"))
    assert len(marks) == 2, marks
    assert marks[0].startswith("3 lead changes: a, b, a2 took the lead in turn at ")
    assert marks[1].startswith("c took the lead at ")
