"""The queue pages in admin: the overview, one queue's figures and processes, dead letters and their requeue."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from outbox.queue import api, app_settings
from outbox.queue.models import DeadLetter, QueueCounter, QueueProcess, QueueSample
from outbox.queue.status import QueueStatusReporter
from outbox.queue.topics import ensure_topics
from tests.support.harness import wait_until
from tests.support.queue_harness import new_prefix, queue_settings

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

QUEUES = "/admin/outbox_queue/queue/"
DEAD_LETTERS = "/admin/outbox_queue/deadletter/"


def process(name: str, kind: str, *, queue: str = "", seen: float = 0, in_progress: int = 0,
            stats: dict | None = None) -> QueueProcess:
    now = timezone.now()
    return QueueProcess.objects.create(name=name, kind=kind, queue=queue, host="host-a", pid=42,
                                       started=now - timedelta(hours=1), last_seen=now - timedelta(seconds=seen),
                                       in_progress=in_progress, stats=stats or {})


def dead_letter(queue: str, message_id: str, payload: bytes = b'{"x":1}') -> DeadLetter:
    return DeadLetter.objects.create(queue=queue, message_id=message_id, key=queue.encode(), payload=payload,
                                     headers=[["trace", "t-1"]], deliveries=5,
                                     last_delivered=timezone.now() - timedelta(minutes=3))


@pytest.fixture
def superuser_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    return client


@pytest.fixture
def example(db):
    """Two live consumers of emails, one gone; a tracker holding 3 emails in progress since 10 minutes."""
    started = (datetime.now(UTC) - timedelta(minutes=10)).timestamp()
    process("tracker-1", "tracker", in_progress=3, stats={
        "partitions": [0, 1], "replaying": [], "queues": {"emails": {"in_progress": 3, "oldest_started": started}},
        "markers": {"emails": {"starts": 40, "ends": 37}}})
    process("emails-1", "consumer", queue="emails", in_progress=2,
            stats={"handler": "shop.handlers.send", "workers": 2, "inbox": True, "received": 40, "acked": 37,
                   "retried": 1, "abandoned": 0})
    process("emails-2", "consumer", queue="emails", stats={"handler": "shop.handlers.send", "workers": 1})
    process("old-1", "consumer", queue="emails", seen=600)
    QueueCounter.objects.create(queue="emails", redelivered=7, dead_lettered=1)
    dead_letter("emails", "m-1")
    dead_letter("reports", "m-2")


def test_the_pages_are_for_staff_only():
    assert Client().get(QUEUES).url.startswith("/admin/login/")
    assert Client().get(f"{QUEUES}emails/").url.startswith("/admin/login/")
    client = Client()
    client.force_login(User.objects.create_user("plain", password="pw"))
    assert client.get(QUEUES).status_code == 302


def test_the_overview_lists_every_queue_with_its_figures(superuser_client, example):
    page = superuser_client.get(QUEUES).content.decode()
    assert page.count('class="queue-row"') == 2  # emails (consumed, tracked) and reports (dead letters only)
    emails = page.split('class="queue-row"')[1]
    assert ">emails</a>" in emails and ">3</td>" in emails and "10\xa0minutes" in emails and ">7</td>" in emails
    assert "old-1" in page and "consumer, gone" in page
    assert 'id="no-tracker"' not in page


def test_a_queue_page_shows_in_progress_oldest_redeliveries_dead_letters_consumers_and_trackers(
        superuser_client, example):
    response = superuser_client.get(f"{QUEUES}emails/")
    assert response.status_code == 200
    page = response.content.decode()
    assert '<td id="in-progress">3</td>' in page
    assert "10\xa0minutes ago" in page
    assert '<td id="redelivered">7</td>' in page
    assert f'{DEAD_LETTERS}?queue__exact=emails">1</a>' in page
    assert '<td id="live">2 / 1</td>' in page
    assert page.count('class="consumer-row"') == 2 and "(inbox), 2 worker(s)" in page
    assert "37 / 37" not in page and "40 / 37" in page
    assert page.count('class="dead-letter-row"') == 1 and "m-1" in page and "m-2" not in page


def test_a_queue_nobody_tracks_says_so(superuser_client, db):
    page = superuser_client.get(f"{QUEUES}unknown/").content.decode()
    assert 'id="no-tracker"' in page and '<td id="in-progress">0</td>' in page
    assert superuser_client.get(f"{QUEUES}bad%20name/").status_code == 404


def test_dead_letters_are_read_only(superuser_client, example):
    letter = DeadLetter.objects.get(message_id="m-1")
    assert superuser_client.get(f"{DEAD_LETTERS}{letter.pk}/change/").status_code == 200
    assert superuser_client.get(f"{DEAD_LETTERS}add/").status_code == 403
    page = superuser_client.get(f"{DEAD_LETTERS}?queue__exact=emails").content.decode()
    assert "m-1" in page and "m-2" not in page


@pytest.mark.django_db(transaction=True)
def test_requeue_sends_a_dead_letter_back_with_its_id_after_a_confirmation(superuser_client, settings):
    settings.OUTBOX = {**settings.OUTBOX, "queues": queue_settings(new_prefix())}
    ensure_topics(app_settings.queue_config(), 10)
    letter = dead_letter("emails", "m-requeued", payload=b"again")
    form = {"action": "requeue_selected", "_selected_action": [letter.pk]}
    confirm = superuser_client.post(DEAD_LETTERS, form)
    assert b"Requeue these 1 dead letter(s)?" in confirm.content and DeadLetter.objects.filter(pk=letter.pk).exists()
    done = superuser_client.post(DEAD_LETTERS, {**form, "post": "yes"}, follow=True)
    assert b"Requeued 1 dead letter(s)." in done.content
    assert not DeadLetter.objects.filter(pk=letter.pk).exists()
    assert LogEntry.objects.get(object_id=str(letter.pk)).action_flag == CHANGE
    with api.consumer("emails") as consumer:
        message = wait_until(lambda: consumer.receive(timeout=0.5), 30, "the requeued message")
        message.ack()
    assert (message.id, message.payload, message.deliveries, message.headers) == ("m-requeued", b"again", 1,
                                                                                  [("trace", "t-1")])


# -- charts -----------------------------------------------------------------------------------------

def tracker_samples(process_name: str, queue: str, *, minutes: int = 30, every: float = 10.0, in_progress: int = 4,
                    redelivered_per_minute: float = 6.0, dead_per_minute: float = 0.0, now=None) -> None:
    """A tracker's samples of one queue over the last `minutes`, as its status reporter writes them."""
    now = now or timezone.now()
    count = int(minutes * 60 / every)
    QueueSample.objects.bulk_create([
        QueueSample(at=now - timedelta(seconds=(count - 1 - i) * every), process=process_name, queue=queue,
                    in_progress=in_progress, redelivered=int(i * every * redelivered_per_minute / 60),
                    dead_lettered=int(i * every * dead_per_minute / 60)) for i in range(count)])


def chart(page: str, title: str) -> str:
    found = re.search(rf'data-title="{re.escape(title)}">(.*?)</figure>', page, re.S)
    assert found, f"no chart {title!r}"
    return found.group(1)


def test_a_queue_page_charts_in_progress_redeliveries_and_dead_letters_summed_over_its_trackers(superuser_client):
    now = timezone.now()
    # Two trackers share the partitions of emails; samples ten seconds apart, not aligned.
    tracker_samples("tracker-1", "emails", in_progress=4, redelivered_per_minute=6.0, dead_per_minute=3.0, now=now)
    tracker_samples("tracker-2", "emails", in_progress=3, redelivered_per_minute=6.0,
                    now=now - timedelta(seconds=4))
    tracker_samples("tracker-1", "reports", in_progress=1, now=now)
    page = superuser_client.get(f"{QUEUES}emails/").content.decode()
    in_progress = chart(page, "Messages in progress")
    values = re.findall(r"emails: (\d+) at", in_progress)
    assert values and set(values[1:-1]) == {"7"}, "each bucket adds up both trackers' latest figures"
    rates = chart(page, "Redeliveries and dead letters per minute")
    redelivered = [float(v) for v in re.findall(r"redelivered: ([\d.]+)/min at", rates)]
    dead = [float(v) for v in re.findall(r"dead-lettered: ([\d.]+)/min at", rates)]
    assert redelivered and all(10 <= v <= 14 for v in redelivered[2:-1]), redelivered
    assert dead and all(2 <= v <= 4 for v in dead[2:-1]), dead
    assert "reports" not in in_progress
    overview = superuser_client.get(QUEUES).content.decode()
    assert re.findall(r'data-title="([^"]+)"', overview) == ["Messages in progress", "Redeliveries per minute",
                                                             "Dead letters per minute"]
    legend = chart(overview, "Messages in progress")
    assert "emails" in legend and "reports" in legend


@pytest.mark.django_db(transaction=True)  # the reporter writes on a connection of its own
def test_the_tracker_samples_its_queues_and_prunes_old_samples():
    QueueSample.objects.create(at=timezone.now() - timedelta(days=2), process="gone", queue="emails")
    stats = {"queues": {"emails": {"in_progress": 2, "oldest_started": None}}, "redelivered": {"emails": 5},
             "dead_lettered": {"reports": 1}}
    reporter = QueueStatusReporter("tracker-x", "tracker", interval=0.05, snapshot=lambda: (2, stats),
                                   history_interval=0.05, history_retention=3600)
    reporter.start()
    try:
        wait_until(lambda: QueueSample.objects.filter(process="tracker-x").count() >= 4, 10, "two rounds of samples")
    finally:
        reporter.stop()
    assert not QueueSample.objects.filter(process="gone").exists()
    rows = {(s.queue, s.in_progress, s.redelivered, s.dead_lettered) for s in QueueSample.objects.all()}
    assert rows == {("emails", 2, 5, 0), ("reports", 0, 0, 1)}
    consumer = QueueStatusReporter("consumer-x", "consumer", queue="emails", interval=0.05, snapshot=lambda: (0, {}),
                                   history_interval=0.05)
    consumer.start()
    wait_until(lambda: QueueProcess.objects.filter(name="consumer-x").exists(), 10, "the consumer's row")
    consumer.stop()
    assert not QueueSample.objects.filter(process="consumer-x").exists(), \
        "a markers queue's consumers leave the queue's figures to its trackers"


def test_a_young_trackers_first_redeliveries_are_charted(superuser_client):
    """Redeliveries within a process's first bucket count: it samples at once when it starts."""
    now = timezone.now()
    tracker_samples("tracker-new", "emails", minutes=0.5, every=10.0, redelivered_per_minute=12.0, now=now)
    rates = chart(superuser_client.get(f"{QUEUES}emails/").content.decode(), "Redeliveries and dead letters per minute")
    found = [float(v) for v in re.findall(r"redelivered: ([\d.]+)/min at", rates)]
    assert found and set(found) == {12.0}, found  # its 30 s are one or two buckets: each counted


@pytest.mark.django_db(transaction=True)  # the reporter writes on a connection of its own
def test_a_share_queues_consumers_sample_what_the_broker_redelivered_and_the_chart_carries_it(superuser_client):
    from types import SimpleNamespace

    from outbox.queue.config import QueueLimits
    from outbox.queue.status import consumer_status

    consumer = SimpleNamespace(queue="reports", limits=QueueLimits(backend="share"), in_progress=1, received=9,
                               acked=5, retried=0, abandoned=4, redelivered=0, dead_lettered=0,
                               oldest_in_progress=lambda: None, waiting_for=lambda: None)
    reporter = QueueStatusReporter("share-consumer-x", "consumer", queue="reports", interval=0.05,
                                   snapshot=lambda: consumer_status(consumer),
                                   totals=lambda: ({"reports": consumer.redelivered},
                                                   {"reports": consumer.dead_lettered}),
                                   history_interval=0.05)
    reporter.start()
    try:
        wait_until(lambda: QueueSample.objects.filter(process="share-consumer-x").exists(), 10, "a first sample")
        consumer.redelivered, consumer.dead_lettered = 3, 1  # the broker redelivered three times; one dead letter
        wait_until(lambda: QueueSample.objects.filter(process="share-consumer-x", redelivered=3).exists(), 10,
                   "a sample with the redeliveries")
    finally:
        reporter.stop()
    counter = QueueCounter.objects.get(queue="reports")
    assert (counter.redelivered, counter.dead_lettered) == (3, 1), "the Queues table's columns"
    page = superuser_client.get(f"{QUEUES}reports/").content.decode()
    rates = chart(page, "Redeliveries and dead letters per minute")
    for series in ("redelivered", "dead-lettered"):  # samples 50 ms apart: thousands a minute, "1.3k/min"
        assert any(float(v) > 0 for v in re.findall(rf"{series}: ([\d.]+)k?/min at", rates)), rates


def test_the_overview_says_where_in_progress_comes_from_for_each_kind_of_queue(superuser_client, example, settings):
    """Trackers for markers queues, consumers for share queues (which have no trackers); a queue known by its dead
    letters alone (reports) is of its configured backend too."""
    def said() -> str:
        page = superuser_client.get(QUEUES).content.decode()
        return page.split('id="in-progress-source">')[1].split(" A process")[0]

    assert said() == "In progress and the oldest message come from the live trackers, which rebuild them from the " \
                     "markers log."
    settings.OUTBOX = {**settings.OUTBOX, "queues": {**queue_settings(new_prefix()),
                                                     "per_queue": {"reports": {"backend": "share"}}}}
    assert said().endswith("from the markers log; a share queue's from its live consumers.")
    settings.OUTBOX = {**settings.OUTBOX, "queues": {**queue_settings(new_prefix()), "backend": "share"}}
    assert said() == "In progress and the oldest message come from the live consumers (share queues have no trackers)."
