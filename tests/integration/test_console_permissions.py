"""Who may see and do what on the console, tried as a new user would (Django's test client, a staff user given
permissions through the admin's own Permission rows), for four roles on every page and action:

    nobody     staff, no permission                   every page 403, nothing changes
    viewer     view outbox records, parked records    every page; no button, no action changes anything
               and queue dead letters
    operator   viewer + delete (and add) of records,  every page and every action
               parked records and dead letters
    superuser  everything                             every page and every action

The dashboard and its charts take the view permission of outbox records, the queue pages that of queue dead
letters (docs/operations.md, "Who sees the console")."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.utils import timezone

from outbox.harvest.contract import ReplicaState
from outbox.models import DeadLetter, OutboxRecord
from outbox.queue import api, app_settings
from outbox.queue.models import DeadLetter as QueueDeadLetter
from outbox.queue.topics import ensure_topics
from tests.support.history_rows import samples
from tests.support.queue_harness import new_prefix, queue_settings
from tests.support.status_rows import held_record, status_row

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

VIEW = [("outbox", "view_outboxrecord"), ("outbox", "view_deadletter"), ("outbox_queue", "view_deadletter")]
OPERATE = [*VIEW, ("outbox", "delete_outboxrecord"), ("outbox", "add_outboxrecord"), ("outbox", "delete_deadletter"),
           ("outbox_queue", "delete_deadletter")]
ROLES = ["nobody", "viewer", "operator", "superuser"]
MAY_ACT = {"operator", "superuser"}


def client_for(role: str) -> Client:
    if role == "superuser":
        user = User.objects.create_superuser("root", "root@example.com", None)
    else:
        user = User.objects.create_user(role, password=None, is_staff=True)
        perms = {"nobody": [], "viewer": VIEW, "operator": OPERATE}[role]
        user.user_permissions.add(*[Permission.objects.get(content_type__app_label=app, codename=code)
                                    for app, code in perms])
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def world(db):
    """A live leader holding a poison record, a record stuck (old, failing, not read by the leader), a parked
    record, a queue with a dead letter, and an hour of history."""
    live_id = uuid.uuid4()
    bad = OutboxRecord.objects.create(kafka_topic="orders", kafka_key="order-9", kafka_value="x",
                                      reset_count=1, last_error="Broker: Message size too large")
    stuck = OutboxRecord.objects.create(kafka_topic="orders", kafka_key="ancient", kafka_value="v", reset_count=4,
                                        last_error="Local: Message timed out")
    OutboxRecord.objects.filter(pk=stuck.pk).update(create_time=timezone.now() - timedelta(hours=1))
    status_row("replica-a", ReplicaState.LEADER, leader_id=live_id, held=[held_record(bad.id, "order-9")])
    samples("replica-a", minutes=60, leading_from=60)
    parked = DeadLetter.objects.create(outbox_id=7, create_time=timezone.now(), kafka_topic="orders",
                                       kafka_key="order-1", kafka_value="v", reason="r", parked_by="admin root")
    letter = QueueDeadLetter.objects.create(queue="emails", message_id="m-1", payload=b"{}", deliveries=5,
                                            last_delivered=timezone.now())
    return {"held": bad, "stuck": stuck, "parked": parked, "letter": letter}


def pages(world: dict) -> list[str]:
    return ["/admin/outbox/dashboard/", "/admin/outbox/dashboard/?span=24h&refresh=5",
            "/admin/outbox/outboxrecord/", f"/admin/outbox/outboxrecord/{world['held'].id}/change/",
            "/admin/outbox/deadletter/", f"/admin/outbox/deadletter/{world['parked'].id}/change/",
            "/admin/outbox_queue/queue/", "/admin/outbox_queue/queue/emails/", "/admin/outbox_queue/queue/?span=6h",
            "/admin/outbox_queue/deadletter/", f"/admin/outbox_queue/deadletter/{world['letter'].id}/change/"]


@pytest.mark.parametrize("role", ROLES)
def test_every_page(role, world):
    client = client_for(role)
    for url in pages(world):
        response = client.get(url)
        assert response.status_code == (403 if role == "nobody" else 200), url
        if role == "nobody":
            assert b"order-9" not in response.content and b"replica-a" not in response.content
    index = client.get("/admin/").content.decode()
    for entry in ("/admin/outbox/dashboard/", "/admin/outbox_queue/queue/"):
        assert (entry in index) is (role != "nobody"), entry
    if role != "nobody":
        dashboard = client.get("/admin/outbox/dashboard/").content.decode()
        assert "order-9" in dashboard and dashboard.count('<svg class="outbox-chart"') == 5
        for button in ("retry-button", "park-button", "requeue-button", "delete-button"):
            assert (button in dashboard) is (role in MAY_ACT), button


def held_retried(world: dict) -> bool:
    return OutboxRecord.objects.get(pk=world["held"].pk).last_error.startswith("retry requested")


ACTIONS: list[tuple[str, str, Callable[[dict], list[int]], Callable[[dict], bool]]] = [
    ("/admin/outbox/outboxrecord/", "retry_selected", lambda w: [w["held"].id], held_retried),
    ("/admin/outbox/outboxrecord/", "park_selected", lambda w: [w["held"].id],
     lambda w: not OutboxRecord.objects.filter(pk=w["held"].pk).exists()),
    ("/admin/outbox/outboxrecord/", "requeue_selected", lambda w: [w["stuck"].id],
     lambda w: OutboxRecord.objects.get(pk=w["stuck"].pk).reset_count == 0),
    ("/admin/outbox/outboxrecord/", "delete_selected", lambda w: [w["stuck"].id],
     lambda w: not OutboxRecord.objects.filter(pk=w["stuck"].pk).exists()),
    ("/admin/outbox/deadletter/", "republish_selected", lambda w: [w["parked"].id],
     lambda w: OutboxRecord.objects.filter(kafka_key="order-1").exists()),
    ("/admin/outbox/deadletter/", "delete_selected", lambda w: [w["parked"].id],
     lambda w: not DeadLetter.objects.filter(pk=w["parked"].pk).exists()),
    ("/admin/outbox_queue/deadletter/", "delete_selected", lambda w: [w["letter"].id],
     lambda w: not QueueDeadLetter.objects.filter(pk=w["letter"].pk).exists()),
]


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize(("url", "action", "selected", "done"), ACTIONS, ids=[f"{u.split('/')[2]}-{a}"
                                                                               for u, a, _, _ in ACTIONS])
def test_every_action(role, url, action, selected, done, world):
    client = client_for(role)
    offered = client.get(url)
    assert (f'value="{action}"' in offered.content.decode()) is (role in MAY_ACT)
    response = client.post(url, {"action": action, "_selected_action": selected(world), "post": "yes", "index": 0})
    assert response.status_code in ((403,) if role == "nobody" else (200, 302))
    assert done(world) is (role in MAY_ACT), f"{action} by {role}"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("role", ROLES)
def test_requeueing_a_queue_dead_letter(role, settings):
    settings.OUTBOX = {**settings.OUTBOX, "queues": queue_settings(new_prefix())}
    ensure_topics(app_settings.queue_config(), 10)
    letter = QueueDeadLetter.objects.create(queue="emails", message_id=f"m-{role}", payload=b"{}", deliveries=5,
                                            last_delivered=timezone.now())
    client = client_for(role)
    response = client.post("/admin/outbox_queue/deadletter/", {"action": "requeue_selected", "post": "yes",
                                                               "_selected_action": [letter.pk]})
    assert response.status_code in ((403,) if role == "nobody" else (200, 302))
    assert QueueDeadLetter.objects.filter(pk=letter.pk).exists() is (role not in MAY_ACT)
    if role in MAY_ACT:
        with api.consumer("emails") as consumer:
            message = consumer.receive(timeout=30)
            assert message is not None and message.id == f"m-{role}", "the message is back in its queue"
            message.ack()
