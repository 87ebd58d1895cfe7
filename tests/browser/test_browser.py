"""An operator in a real browser, against real harvesters: logs into admin, sees every record state
and the fence alarm, retries, parks and republishes a poison record. Headless Debian Chromium via
Playwright; screenshots go to .artifacts/screenshots/ (git-ignored)."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta
from typing import Any

import pytest
from confluent_kafka import Producer
from django.contrib.auth.models import User
from django.db import connections, transaction
from django.utils import timezone

from outbox import stash_many
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.connector import LiveConnector
from outbox.harvest.harvester import Harvester
from outbox.harvest.kafka import record_producer_config
from outbox.harvest.store import PostgresStore
from outbox.models import OutboxRecord
from tests.support.harness import wait_until
from tests.support.screenshots import SCREENSHOTS

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.django_db(transaction=True)]


class HeldProducer:
    """Sends for real, but serves no delivery report until released: records stay in flight."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._producer = Producer(config)
        self.released = threading.Event()

    def produce(self, *args: Any, **kwargs: Any) -> None:
        self._producer.produce(*args, **kwargs)

    def poll(self, timeout: float = 0) -> int:
        if not self.released.is_set():
            self.released.wait(timeout)
            return 0
        return self._producer.poll(timeout)

    def flush(self, timeout: float = 0) -> int:
        self.released.set()
        return self._producer.flush(timeout)

    def purge(self, *args: Any, **kwargs: Any) -> None:
        self._producer.purge(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._producer)


class FirstBatchStore:
    """The real store, but the leader only ever marks its first batch: a row left behind stays stuck."""

    def __init__(self, store: PostgresStore) -> None:
        self._store, self._marked_once = store, False

    def mark(self, limit: int, after: int, gaps: Any = ()) -> Any:
        if self._marked_once:
            return [], frozenset()
        marked = self._store.mark(limit, after, gaps)
        self._marked_once = bool(marked[0])
        return marked

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def login(page: Any, url: str) -> None:
    page.goto(url)
    assert "/admin/login/" in page.url, "a stranger is sent to the login page"
    page.fill("#id_username", "operator")
    page.fill("#id_password", "s3cret-pw")
    page.click("input[type=submit]")
    page.wait_for_url(url)


def shot(page: Any, name: str) -> None:
    page.screenshot(path=SCREENSHOTS / f"{name}.png", full_page=True)


def message(page: Any) -> str:
    return page.locator("ul.messagelist").inner_text().strip()


def test_operator_sees_every_state_the_fence_alarm_and_acts_on_a_poison_record(
        live_server, browser, database_url, bootstrap_servers, new_topic, monkeypatch):
    """One real leader (its producer keeps delivery reports back until released, its store marks
    only its first batch), a second replica of another leader group on the same table, and an
    operator: every record state on the records page, the fence alarm on the dashboard, then
    retry now, park and republish of a record too large for Kafka."""
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API runs an event loop
    User.objects.create_superuser("operator", "op@example.com", "s3cret-pw")
    topic = new_topic("browser")
    with transaction.atomic():
        stash_many([{"topic": topic, "key": f"order-{i}", "value": str(i)} for i in range(3)])
        # Larger than the producer's message.max.bytes (stash() would refuse it; a plain-SQL writer may not).
        poison = OutboxRecord.objects.create(kafka_topic=topic, kafka_key="order-poison", kafka_value="x" * 1_200_000)
        [behind_id] = stash_many([{"topic": topic, "key": "order-poison", "value": "after the poison"}])
        old = OutboxRecord.objects.create(kafka_topic=topic, kafka_key="order-old", kafka_value="late")
        OutboxRecord.objects.filter(pk=old.pk).update(create_time=timezone.now() - timedelta(hours=1))

    producers: list[HeldProducer] = []

    class Held(LiveConnector):
        def record_producer(self) -> HeldProducer:
            producers.append(HeldProducer(record_producer_config(self.config)))
            return producers[-1]

        def open_store(self) -> Any:
            return FirstBatchStore(super().open_store())

    def config(name: str) -> HarvestConfig:
        group = f"test-leader-{uuid.uuid4().hex[:8]}"
        # Nothing is given up while reports are held back: delivery and queue timeouts out of the way. One
        # record per key in flight, so the record behind the poison waits in its lane, never sent with it.
        return HarvestConfig(dsn=database_url, base_kafka_config={"bootstrap.servers": bootstrap_servers},
                             leader_topic=group, leader_group=group, name=name,
                             limits=Limits(heartbeat_timeout=5.0, status_interval=0.3, delivery_timeout=600,
                                           queue_timeout=600, max_in_flight_per_key=1))

    leader_config = config("browser-a")
    harvester = Harvester(leader_config, connector=Held(leader_config))
    other = Harvester(config("browser-b"))  # another leader group, same table: the fence blocks it
    harvester.start()
    try:
        wait_until(lambda: harvester.in_flight_records == 4 and len(harvester.held) == 1, 30,
                   "four records in flight and one held")
        # Its failure noted on its row: from here on only a change to the row makes the leader retry it.
        wait_until(lambda: OutboxRecord.objects.get(pk=poison.pk).reset_count == 1, 10, "the hold to be noted")
        late = OutboxRecord.objects.create(kafka_topic=topic, kafka_key="order-late", kafka_value="y")  # never marked
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        login(page, f"{live_server.url}/admin/outbox/dashboard/")

        def dashboard_shows(selector: str, count: int) -> bool:
            page.reload()
            return page.locator(selector).count() == count

        wait_until(lambda: dashboard_shows(".in-flight-key", 4) and dashboard_shows("tr.held-record", 1), 15,
                   "in-flight keys and the held record on the dashboard", interval=0.5)
        assert page.locator(".leader-name").inner_text() == "browser-a"
        assert page.locator(".leader-id").inner_text() == str(harvester.leader_id)
        assert page.locator(".outbox-warning").count() == 0
        held_row = page.locator("tr.held-record")
        assert "order-poison" in held_row.inner_text() and "too large" in held_row.inner_text().lower()
        assert held_row.locator(".held-behind").inner_text() == "1"
        assert "order-old" in page.locator("tr.stuck-record").inner_text()
        shot(page, "dashboard")

        page.goto(f"{live_server.url}/admin/outbox/outboxrecord/")
        shown = {int(record_id): state for record_id, state in zip(
            page.locator("th.field-id").all_inner_texts(), page.locator("td.field-state").all_inner_texts(),
            strict=True)}
        flying = OutboxRecord.objects.filter(kafka_key__in=["order-0", "order-1", "order-2"]).values_list("id",
                                                                                                        flat=True)
        assert shown == {**{record_id: "in flight" for record_id in flying}, poison.id: "held",
                         behind_id: f"waiting behind #{poison.id}", old.id: "stuck", late.id: "waiting"}
        shot(page, "records")

        other.start()
        page.goto(f"{live_server.url}/admin/outbox/dashboard/")
        wait_until(lambda: dashboard_shows("#outbox-warning-fence", 1), 30, "the fence alarm", interval=0.5)
        alarm = page.locator("#outbox-warning-fence").inner_text()
        assert "Two leader groups harvest one table" in alarm and "browser-b" in alarm and "browser-a" in alarm
        shot(page, "fence-alarm")
        other.stop()
        other.wait(timeout=30)

        # Let the leader's records land; then act on the poison record from the dashboard.
        producers[-1].released.set()
        wait_until(lambda: not OutboxRecord.objects.filter(kafka_key__in=["order-0", "order-old"]).exists(), 30,
                   "the in-flight records to be published")
        page.reload()
        failures = OutboxRecord.objects.get(pk=poison.pk).reset_count
        page.locator("tr.held-record input.held-select").check()
        page.click("#retry-button")
        page.wait_for_selector("#confirm-action")
        assert "No, take me back" in page.locator("a.cancel-link").inner_text()
        shot(page, "retry-confirmation")
        page.click("#confirm-action")
        page.wait_for_url("**/admin/outbox/dashboard/")
        assert message(page) == f"Asked the leader to retry 1 record: #{poison.id}."
        # The retry note on the row is replaced by the error of the leader's next attempt, which
        # counts one failure more: the leader retried it after the operator asked, and holds it again.
        wait_until(lambda: (row := OutboxRecord.objects.get(pk=poison.pk)).reset_count > failures
                   and not row.last_error.startswith("retry requested"), 10, "the leader to retry it")
        assert [h.id for h in harvester.held] == [poison.id]

        page.locator("tr.held-record input.held-select").check()
        page.click("#park-button")
        page.wait_for_selector("#confirm-action")
        shot(page, "park-confirmation")
        page.click("#confirm-action")
        page.wait_for_url("**/admin/outbox/dashboard/")
        assert message(page) == f"Parked 1 record: #{poison.id}."
        wait_until(lambda: not OutboxRecord.objects.filter(pk=behind_id).exists(), 10,
                   "the record behind it to be published")
        wait_until(lambda: dashboard_shows("tr.held-record", 0), 10, "no held record on the dashboard", interval=0.5)
        assert page.locator("#backlog-parked").inner_text() == "1"
        shot(page, "parked")

        page.click("#parked-link")
        # Read once loaded: a read right after the click can find the table half parsed (its header alone).
        page.wait_for_url("**/admin/outbox/deadletter/**")
        # Held before it was produced: the reason names the topic's limit (outbox/harvest/topics.py).
        assert "too large: 1,200," in page.locator("#result_list").inner_text()
        shot(page, "parked-records")
        page.locator("tr:has-text('order-poison') input.action-select").check()
        page.select_option("select[name=action]", "republish_selected")
        page.click("button[name=index]")
        page.wait_for_selector("#confirm-action")
        assert "AFTER the records of its key written since" in page.locator("#outbox-explanation").inner_text()
        shot(page, "republish-confirmation")
        page.click("#confirm-action")
        page.wait_for_selector("ul.messagelist")
        assert message(page).startswith("Republished 1 record")
        back = OutboxRecord.objects.get(kafka_key="order-poison")
        assert back.id > behind_id > poison.id, "it comes back after its key's later records"
        page.goto(f"{live_server.url}/admin/outbox/outboxrecord/?state=waiting")
        assert sorted(page.locator("td.field-kafka_key").all_inner_texts()) == ["order-late", "order-poison"]
        shot(page, "republished")
        assert late.pk in set(OutboxRecord.objects.values_list("id", flat=True))
    finally:
        for producer in producers:
            producer.released.set()
        for replica in (other, harvester):
            replica.stop()
            replica.wait(timeout=30)
        # Playwright's greenlets give ORM calls made meanwhile a context (and connection) of their own.
        connections.close_all()
