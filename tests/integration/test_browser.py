"""An operator in a real browser: logs into admin while a real harvester leads, sees the leader and
in-flight keys on the dashboard, and requeues a stuck row. Headless Debian Chromium via Playwright;
screenshots go to .artifacts/screenshots/ (git-ignored)."""

from __future__ import annotations

import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from django.contrib.auth.models import User
from django.db import connections, transaction

from outbox import stash_many
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.connector import LiveConnector
from outbox.harvest.harvester import Harvester
from outbox.harvest.kafka import record_producer_config
from outbox.harvest.store import PostgresStore
from outbox.models import OutboxRecord
from tests.integration.harness import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOTS = Path(__file__).resolve().parents[2] / ".artifacts" / "screenshots"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


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

    def mark(self, leader_id: uuid.UUID, limit: int, after: int, upto: int | None = None) -> Any:
        if self._marked_once:
            return [], (0, 0)
        marked = self._store.mark(leader_id, limit, after, upto)
        self._marked_once = bool(marked[0])
        return marked

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@pytest.fixture
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail("Chromium is missing: `bin/services up` installs Debian's chromium package")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield instance
        instance.close()


def test_operator_sees_the_leader_and_requeues_a_stuck_row(live_server, browser, database_url, bootstrap_servers,
                                                            new_topic, monkeypatch):
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API runs an event loop
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    User.objects.create_superuser("operator", "op@example.com", "s3cret-pw")
    topic = new_topic("browser")
    with transaction.atomic():
        stash_many([{"topic": topic, "key": f"order-{i}", "value": str(i)} for i in range(3)])

    producers: list[HeldProducer] = []

    class Held(LiveConnector):
        def record_producer(self) -> HeldProducer:
            producers.append(HeldProducer(record_producer_config(self.config)))
            return producers[-1]

        def open_store(self) -> Any:
            return FirstBatchStore(super().open_store())

    leader_topic = f"test-leader-{uuid.uuid4().hex[:8]}"
    config = HarvestConfig(dsn=database_url, base_kafka_config={"bootstrap.servers": bootstrap_servers},
                           leader_topic=leader_topic, leader_group=leader_topic, name="browser-replica",
                           limits=Limits(heartbeat_timeout=5.0, status_interval=0.3))
    harvester = Harvester(config, connector=Held(config))
    harvester.start()
    try:
        wait_until(lambda: harvester.in_flight_records == 3, 30, "three records in flight")
        stuck = OutboxRecord.objects.create(kafka_topic=topic, kafka_key="order-stuck", kafka_value="x",
                                            leader_id=uuid.uuid4())  # marked by a leader that is gone

        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.goto(f"{live_server.url}/admin/outbox/dashboard/")
        assert "/admin/login/" in page.url, "the dashboard sends a stranger to the login page"
        page.fill("#id_username", "operator")
        page.fill("#id_password", "s3cret-pw")
        page.click("input[type=submit]")
        page.wait_for_url("**/admin/outbox/dashboard/")

        def leader_shown() -> bool:
            page.reload()
            return page.locator(".leader-name").count() == 1 and page.locator(".in-flight-key").count() == 3

        wait_until(leader_shown, 15, "the leader and its in-flight keys on the dashboard", interval=0.5)
        assert page.locator(".leader-name").inner_text() == "browser-replica"
        assert page.locator(".leader-id").inner_text() == str(harvester.leader_id)
        assert sorted(page.locator(".in-flight-key").all_inner_texts()) == ["order-0", "order-1", "order-2"]
        assert page.locator("#outbox-warning").count() == 0
        page.screenshot(path=SCREENSHOTS / "dashboard.png", full_page=True)

        row = page.locator("tr.stuck-record", has_text="order-stuck")
        assert "which no live replica holds" in row.inner_text()
        row.locator("input.stuck-select").check()
        page.click("#requeue-button")
        page.wait_for_selector("#confirm-requeue")
        page.screenshot(path=SCREENSHOTS / "requeue-confirmation.png", full_page=True)
        page.click("#confirm-requeue")
        page.wait_for_selector("ul.messagelist")
        assert "Requeued 1 outbox record(s)." in page.locator("ul.messagelist").inner_text()
        page.screenshot(path=SCREENSHOTS / "requeued.png", full_page=True)
        stuck.refresh_from_db()
        assert stuck.leader_id is None
    finally:
        for producer in producers:
            producer.released.set()
        harvester.stop()
        harvester.wait(timeout=30)
        # Playwright's greenlets give ORM calls made meanwhile a context (and connection) of their own.
        connections.close_all()
