"""An operator in a real browser: the queue pages while a real tracker and consumer run, and a dead
letter requeued. Headless Debian Chromium via Playwright; screenshots in .artifacts/screenshots/."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.db import connections

from outbox.queue import api, app_settings
from outbox.queue.models import DeadLetter
from outbox.queue.status import QueueStatusReporter, consumer_status, tracker_status
from outbox.queue.topics import ensure_topics
from tests.support.harness import wait_until
from tests.support.queue_harness import new_prefix, queue_settings, running_tracker, share_groups_missing
from tests.support.screenshots import SCREENSHOTS

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_an_operator_watches_a_queue_and_requeues_a_dead_letter(live_server, browser, settings, monkeypatch):
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API runs an event loop
    # A long redelivery timeout: no keep-alive delayed by Chromium on two cores causes a stray redelivery.
    settings.OUTBOX = {**settings.OUTBOX,
                       "queues": queue_settings(new_prefix(), status_gone_after=60, redelivery_timeout=30)}
    config = app_settings.queue_config()
    ensure_topics(config, 10)
    User.objects.create_superuser("operator", "op@example.com", "s3cret-pw")
    poison = api.send("emails", {"to": "nobody@example.com"}, headers=[("trace", "t-7")])
    held_ids = api.send_many("emails", [{"to": f"user{n}@example.com"} for n in range(3)])

    reporters = []
    with running_tracker(config, name="tracker-a") as tracker, \
            api.consumer("emails", name="emails-worker-1", max_deliveries=1) as consumer:
        reporters.append(QueueStatusReporter(
            "tracker-a", "tracker", interval=0.3, snapshot=lambda: tracker_status(tracker),
            totals=lambda: (tracker.snapshot.redelivered, tracker.snapshot.dead_lettered)))
        reporters.append(QueueStatusReporter("emails-worker-1", "consumer", queue="emails", interval=0.3,
                                             snapshot=lambda: consumer_status(consumer, handler="shop.handlers.send")))
        for reporter in reporters:
            reporter.start()
        try:
            held, retried = [], False
            while len(held) < 3 or not retried:  # in any order: the four may lie in different partitions
                message = wait_until(lambda: consumer.receive(timeout=0.5), 30, "the queue's messages")
                if message.id == poison:
                    message.retry()  # its one allowed delivery fails: a dead letter
                    retried = True
                else:
                    held.append(message)  # in progress: received, not acked
            assert sorted(m.id for m in held) == sorted(held_ids)
            wait_until(lambda: DeadLetter.objects.filter(message_id=poison).exists(), 30, "the dead letter")
            wait_until(lambda: tracker.snapshot.queues.get("emails") and
                       tracker.snapshot.queues["emails"].in_progress == 3, 30, "three messages in progress")

            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(f"{live_server.url}/admin/outbox_queue/queue/")
            assert "/admin/login/" in page.url
            page.fill("#id_username", "operator")
            page.fill("#id_password", "s3cret-pw")
            page.click("input[type=submit]")
            page.wait_for_url("**/admin/outbox_queue/queue/")

            def overview_current() -> bool:
                page.reload()
                row = page.locator("tr.queue-row", has_text="emails")
                return row.count() == 1 and "3" in row.locator("td").nth(1).inner_text() \
                    and row.locator("td").nth(4).inner_text() == "1"

            wait_until(overview_current, 20, "the overview to show emails", interval=0.5)
            assert page.locator("#no-tracker").count() == 0
            page.screenshot(path=SCREENSHOTS / "queues.png", full_page=True)

            page.click("a.queue-name:text('emails')")
            page.wait_for_url("**/admin/outbox_queue/queue/emails/")
            assert page.locator("#in-progress").inner_text() == "3"
            assert "ago" in page.locator("#oldest").inner_text()
            assert page.locator("#redelivered").inner_text() == "0"
            assert page.locator("#dead-letters").inner_text() == "1"
            assert page.locator("#live").inner_text() == "1 / 1"
            assert page.locator("tr.consumer-row", has_text="emails-worker-1").count() == 1
            assert page.locator("tr.tracker-row", has_text="tracker-a").count() == 1
            page.screenshot(path=SCREENSHOTS / "queue-emails.png", full_page=True)

            page.click("#dead-letters a")
            page.wait_for_url("**/admin/outbox_queue/deadletter/?queue__exact=emails")
            page.screenshot(path=SCREENSHOTS / "dead-letters.png", full_page=True)
            page.locator("input.action-select").first.check()
            page.select_option("select[name=action]", "requeue_selected")
            page.click("button[name=index]")
            page.wait_for_selector("#confirm-requeue")
            page.screenshot(path=SCREENSHOTS / "dead-letter-requeue.png", full_page=True)
            page.click("#confirm-requeue")
            page.wait_for_selector("ul.messagelist")
            assert "Requeued 1 dead letter(s)." in page.locator("ul.messagelist").inner_text()
            again = wait_until(lambda: consumer.receive(timeout=0.5), 30, "the requeued message")
            assert (again.id, again.deliveries) == (poison, 1)
            again.ack()
            for message in held:
                message.ack()
        finally:
            for reporter in reporters:
                reporter.stop()
            connections.close_all()


def test_an_operator_watches_a_share_queue(live_server, browser, settings, monkeypatch, bootstrap_servers):
    """A share queue (Kafka 4.2+): in progress from its consumer's status row, no tracker asked for."""
    reason = share_groups_missing(bootstrap_servers)
    if reason is not None:
        pytest.skip(f"the broker at {bootstrap_servers} has no share groups (needs Apache Kafka 4.2+): {reason}")
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    settings.OUTBOX = {**settings.OUTBOX, "queues": queue_settings(
        new_prefix(), status_gone_after=60, redelivery_timeout=30, per_queue={"sms": {"backend": "share"}},
        partitions=1)}  # both messages in one batch: a share consumer polls no more until its batch is settled
    User.objects.create_superuser("operator", "op@example.com", "s3cret-pw")
    api.send_many("sms", ["one", "two"])
    with api.consumer("sms", name="sms-worker-1") as consumer:
        reporter = QueueStatusReporter("sms-worker-1", "consumer", queue="sms", interval=0.3,
                                       snapshot=lambda: consumer_status(consumer, handler="shop.handlers.sms"))
        reporter.start()
        try:
            held = [wait_until(lambda: consumer.receive(timeout=0.5), 30, "the share queue's messages")
                    for _ in range(2)]
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(f"{live_server.url}/admin/outbox_queue/queue/sms/")
            page.fill("#id_username", "operator")
            page.fill("#id_password", "s3cret-pw")
            page.click("input[type=submit]")
            page.wait_for_url("**/admin/outbox_queue/queue/sms/")

            def figures_current() -> bool:
                page.reload()
                return page.locator("#in-progress").inner_text() == "2"

            wait_until(figures_current, 20, "the queue page to show two messages in progress", interval=0.5)
            assert page.locator("#no-tracker").count() == 0, "a share queue needs no tracker"
            assert "share" in page.locator("#backend").inner_text()
            assert "-share-sms" in page.locator("#backend").inner_text()
            page.screenshot(path=SCREENSHOTS / "queue-share.png", full_page=True)
            page.goto(f"{live_server.url}/admin/outbox_queue/queue/")
            assert page.locator("tr.queue-row", has_text="sms").locator(".queue-backend").inner_text() == "share"
            page.screenshot(path=SCREENSHOTS / "queues-share.png", full_page=True)
            for message in held:
                message.ack()
        finally:
            reporter.stop()
            connections.close_all()
