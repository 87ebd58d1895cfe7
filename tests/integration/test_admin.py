"""The admin: dashboard, read-only records, requeue and delete actions, permissions."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.utils import timezone

from outbox.models import HarvesterStatus, OutboxRecord

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

DASHBOARD = "/admin/outbox/dashboard/"
RECORDS = "/admin/outbox/outboxrecord/"


def replica(name: str, state: str = "standby", *, seen: float = 0, leader_id: uuid.UUID | None = None,
            keys: list[str] | None = None, group: str = "g") -> HarvesterStatus:
    now = timezone.now()
    return HarvesterStatus.objects.create(
        name=name, host="host-a", pid=1234, state=state, leader_id=leader_id, since=now - timedelta(minutes=5),
        started=now - timedelta(hours=1), last_seen=now - timedelta(seconds=seen), harvested_table="outbox",
        leader_topic="t", leader_group=group, in_flight=len(keys or []), in_flight_keys=keys or [],
        in_flight_key_count=len(keys or []), throughput=1234.0, published=99)


def record(key: str = "k", *, leader_id: uuid.UUID | None = None, age: float = 0, resets: int = 0,
           error: str | None = None, value: str | None = "v",
           headers: list[tuple[str, str]] | None = None) -> OutboxRecord:
    row = OutboxRecord.objects.create(kafka_topic="orders", kafka_key=key, kafka_value=value, leader_id=leader_id,
                                      reset_count=resets, last_error=error,
                                      kafka_header_keys=[h for h, _ in headers or []],
                                      kafka_header_values=[v for _, v in headers or []])
    if age:
        OutboxRecord.objects.filter(pk=row.pk).update(create_time=timezone.now() - timedelta(seconds=age))
    return row


@pytest.fixture
def superuser_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    return client


@pytest.fixture
def staff_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_user("staff", password="pw", is_staff=True))
    return client


def test_dashboard_sends_anonymous_and_non_staff_users_to_login():
    assert Client().get(DASHBOARD).url.startswith("/admin/login/")
    client = Client()
    client.force_login(User.objects.create_user("visitor", password="pw"))
    response = client.get(DASHBOARD)
    assert response.status_code == 302 and response.url.startswith("/admin/login/")


def test_dashboard_shows_the_leader_standbys_gone_replicas_and_in_flight_keys(staff_client):
    leader_id = uuid.uuid4()
    replica("replica-a", "leader", leader_id=leader_id, keys=["order-17", "order-42"])
    replica("replica-b")
    replica("replica-c", "leader", seen=600, leader_id=uuid.uuid4())
    page = staff_client.get(DASHBOARD).content.decode()
    assert "replica-a" in page and str(leader_id) in page and "1234 records/s" in page
    assert "order-17" in page and "order-42" in page
    assert "gone (was leader)" in page and "replica-c" in page
    assert "claims to lead" not in page and "No replica leads" not in page


def test_dashboard_warns_when_nobody_leads(staff_client):
    replica("replica-b")
    assert "No replica leads" in staff_client.get(DASHBOARD).content.decode()
    HarvesterStatus.objects.all().delete()
    assert "No harvester is running" in staff_client.get(DASHBOARD).content.decode()


def test_dashboard_warns_when_two_replicas_claim_to_lead(staff_client):
    replica("replica-a", "leader", leader_id=uuid.uuid4())
    replica("replica-b", "leader", leader_id=uuid.uuid4())
    replica("other-app", "leader", leader_id=uuid.uuid4(), group="other")  # another group: fine
    page = staff_client.get(DASHBOARD).content.decode()
    assert "More than one replica claims to lead group &#x27;g&#x27; (replica-a, replica-b)" in page


def test_dashboard_shows_backlog_and_stuck_records_with_reasons(staff_client):
    live_id = uuid.uuid4()
    replica("replica-a", "leader", leader_id=live_id)
    record("fresh")
    record("in-flight", leader_id=live_id)
    orphan = record("orphaned", leader_id=uuid.uuid4())
    old = record("ancient", age=3600)
    failing = record("failing", resets=5, error="Broker: Message size too large")
    page = staff_client.get(DASHBOARD).content.decode()
    assert "Oldest row" in page and "In flight" in page
    assert f'value="{orphan.id}"' in page and "which no live replica holds" in page
    assert f'value="{old.id}"' in page and "pending for more than" in page
    assert f'value="{failing.id}"' in page and "delivery failed 5 times: Broker: Message size too large" in page
    stuck_section = page.split('id="stuck"')[1]
    assert "<code>fresh</code>" not in stuck_section and "<code>in-flight</code>" not in stuck_section


def test_requeue_asks_first_then_clears_the_leader_and_logs_it(superuser_client):
    live_id = uuid.uuid4()
    replica("replica-a", "leader", leader_id=live_id)
    orphan = record("orphaned", leader_id=uuid.uuid4(), resets=4, error="timed out")
    in_flight = record("in-flight", leader_id=live_id)
    form = {"action": "requeue_selected", "_selected_action": [orphan.id, in_flight.id], "index": 0}
    confirmation = superuser_client.post(RECORDS, form)
    assert confirmation.status_code == 200 and b"Requeue these 2 outbox record(s)?" in confirmation.content
    orphan.refresh_from_db()
    assert orphan.leader_id is not None, "nothing changes before the confirmation"
    done = superuser_client.post(RECORDS, {**form, "post": "yes"}, follow=True)
    assert b"Requeued 1 outbox record(s)." in done.content
    assert b"Skipped 1 record(s) marked by a live leader" in done.content
    orphan.refresh_from_db()
    in_flight.refresh_from_db()
    assert (orphan.leader_id, orphan.reset_count, orphan.last_error) == (None, 0, None)
    assert in_flight.leader_id == live_id
    entry = LogEntry.objects.get(object_id=str(orphan.id))
    assert entry.action_flag == CHANGE and "Requeued" in entry.get_change_message()
    assert not LogEntry.objects.filter(object_id=str(in_flight.id)).exists()


def test_delete_asks_first_then_deletes_and_logs_it(superuser_client):
    doomed, kept = record("doomed"), record("kept")
    form = {"action": "delete_selected", "_selected_action": [doomed.id], "index": 0}
    confirmation = superuser_client.post(RECORDS, form)
    assert confirmation.status_code == 200 and b"Are you sure" in confirmation.content
    assert OutboxRecord.objects.filter(pk=doomed.pk).exists()
    superuser_client.post(RECORDS, {**form, "post": "yes"})
    assert not OutboxRecord.objects.filter(pk=doomed.pk).exists() and OutboxRecord.objects.filter(pk=kept.pk).exists()
    assert LogEntry.objects.get(object_id=str(doomed.id)).action_flag == DELETION


def test_records_are_read_only(superuser_client):
    row = record("k", value="hello", headers=[("trace", "abc"), ("trace", "def")])
    detail = superuser_client.get(f"{RECORDS}{row.id}/change/").content.decode()
    assert "hello" in detail and "<code>trace</code>: <code>abc</code>" in detail
    assert 'name="_save"' not in detail
    assert superuser_client.post(f"{RECORDS}{row.id}/change/", {"kafka_key": "x"}).status_code == 403
    assert superuser_client.get(f"{RECORDS}add/").status_code == 403
    tombstone = record("t", value=None)
    assert "a tombstone" in superuser_client.get(f"{RECORDS}{tombstone.id}/change/").content.decode()


def test_records_changelist_filters_and_search(superuser_client):
    live_id = uuid.uuid4()
    replica("replica-a", "leader", leader_id=live_id)
    record("pending-key")
    record("flying-key", leader_id=live_id)
    record("stuck-key", leader_id=uuid.uuid4())
    other = OutboxRecord.objects.create(kafka_topic="payments", kafka_key="pay-1")

    def keys(query: str) -> set[str]:
        page = superuser_client.get(f"{RECORDS}?{query}").content.decode()
        return {k for k in ("pending-key", "flying-key", "stuck-key", "pay-1") if f">{k}<" in page}

    assert keys("") == {"pending-key", "flying-key", "stuck-key", "pay-1"}
    assert keys("state=in_flight") == {"flying-key"}
    assert keys("state=pending") == {"pending-key", "stuck-key", "pay-1"}
    assert keys("state=stuck") == {"stuck-key"}
    assert keys("topic=payments") == {other.kafka_key}
    assert keys("q=flying-key") == {"flying-key"}
    assert "in flight" in superuser_client.get(f"{RECORDS}?state=in_flight").content.decode()


def test_staff_without_permissions_sees_the_dashboard_but_not_records_or_actions(staff_client):
    record("orphaned", leader_id=uuid.uuid4())
    page = staff_client.get(DASHBOARD).content.decode()
    assert "orphaned" in page and "requeue-button" not in page and "delete-button" not in page
    assert staff_client.get(RECORDS).status_code == 403


def test_viewers_cannot_requeue(staff_client):
    user = User.objects.get(username="staff")
    user.user_permissions.add(Permission.objects.get(codename="view_outboxrecord"))
    orphan = record("orphaned", leader_id=uuid.uuid4())
    response = staff_client.post(RECORDS, {"action": "requeue_selected", "_selected_action": [orphan.id],
                                           "index": 0, "post": "yes"}, follow=True)
    assert response.status_code == 200
    orphan.refresh_from_db()
    assert orphan.leader_id is not None, "a viewer's requeue is ignored"
    changelist = staff_client.get(RECORDS)
    assert changelist.status_code == 200 and b"requeue_selected" not in changelist.content
