"""The admin through Django's test client: dashboard, records and parked records, their actions
(retry now, park, republish, requeue, delete), their confirmation pages, messages and permissions.
Replicas are status rows written as a running replica writes its own (tests/support/status_rows.py)."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta

import psycopg
import pytest
from django.contrib.admin.models import ADDITION, CHANGE, DELETION, LogEntry
from django.contrib.auth.models import Permission, User
from django.db import connections
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from outbox.harvest.contract import ReplicaState, notify_channel
from outbox.models import DeadLetter, HarvesterStatus, OutboxRecord
from outbox.states import Facts, RecordState
from outbox.templatetags.outbox_admin import ORDERED_BREADCRUMBS
from tests.support.status_rows import held_record, status_row

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

DASHBOARD = "/admin/outbox/dashboard/"
RECORDS = "/admin/outbox/outboxrecord/"
PARKED = "/admin/outbox/deadletter/"
FENCE_HOLDER = "replica replica-a of leader group g on host-a (pid 1234)"
# The breadcrumbs the running Django's admin styles (6.0 made them a list), and the other kind.
BREADCRUMBS, NOT_BREADCRUMBS = (('<ol class="breadcrumbs">', '<div class="breadcrumbs">') if ORDERED_BREADCRUMBS
                                else ('<div class="breadcrumbs">', '<ol class="breadcrumbs">'))


def record(key: str = "k", *, age: float = 0, resets: int = 0,
           error: str | None = None, value: str | None = "v", topic: str = "orders",
           headers: list[tuple[str, str]] | None = None) -> OutboxRecord:
    row = OutboxRecord.objects.create(kafka_topic=topic, kafka_key=key, kafka_value=value,
                                      reset_count=resets, last_error=error,
                                      kafka_header_keys=[h for h, _ in headers or []],
                                      kafka_header_values=[v for _, v in headers or []])
    if age:
        OutboxRecord.objects.filter(pk=row.pk).update(create_time=timezone.now() - timedelta(seconds=age))
        row.refresh_from_db()
    return row


def poison(key: str, leader_id: uuid.UUID | None = None, *,
           error: str = "Broker: Message size too large") -> OutboxRecord:
    """A row as the engine leaves a held record: its failure counted (its leader's status row holds it)."""
    return record(key, resets=1, error=error, value="x" * 2000)


def messages(response) -> list[tuple[str, str]]:
    return [(m.level_tag, m.message) for m in response.context["messages"]]


def changelist(client: Client, query: str = "") -> dict[int, tuple[str, str]]:
    """Id -> (key, the state column's text), for the rows a records changelist shows."""
    page = client.get(f"{RECORDS}?{query}").content.decode()
    rows = re.findall(r'<th class="field-id"><a [^>]*>(\d+)</a></th><td class="field-kafka_topic">[^<]*</td>'
                      r'<td class="field-kafka_key">([^<]*)</td><td class="field-state">'
                      r'<span class="outbox-state [^"]*" title="[^"]*">([^<]*)</span>', page)
    return {int(record_id): (key, state) for record_id, key, state in rows}


def changelist_keys(client: Client, query: str = "") -> set[str]:
    return {key for key, _ in changelist(client, query).values()}


@pytest.fixture
def superuser_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", None))  # no password: no hashing
    return client


@pytest.fixture
def staff_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_user("staff", password=None, is_staff=True))
    return client


@pytest.fixture
def viewer_client() -> Client:
    """Staff who may view outbox records (and so the dashboard), and do nothing else."""
    user = User.objects.create_user("viewer", password=None, is_staff=True)
    user.user_permissions.add(Permission.objects.get(content_type__app_label="outbox", codename="view_outboxrecord"))
    client = Client()
    client.force_login(user)
    return client


# -- the dashboard ----------------------------------------------------------------------------------

def test_dashboard_sends_anonymous_and_non_staff_users_to_login():
    assert Client().get(DASHBOARD).url.startswith("/admin/login/")
    client = Client()
    client.force_login(User.objects.create_user("visitor", password=None))
    response = client.get(DASHBOARD)
    assert response.status_code == 302 and response.url.startswith("/admin/login/")


def test_dashboard_shows_the_leader_standbys_gone_replicas_and_in_flight_keys(viewer_client):
    leader_id = uuid.uuid4()
    status_row("replica-a", ReplicaState.LEADER, leader_id=leader_id, in_flight_keys=["order-17", "order-42"],
               throughput=1234.0)
    status_row("replica-b")
    status_row("replica-c", ReplicaState.LEADER, leader_id=uuid.uuid4(), seen=600)
    page = viewer_client.get(DASHBOARD).content.decode()
    assert "replica-a" in page and str(leader_id) in page and "1234 records/s" in page
    assert "order-17" in page and "order-42" in page
    assert "gone (was leader)" in page and "replica-c" in page
    assert "outbox-warning" not in page


def test_dashboard_warns_when_nobody_leads(viewer_client):
    status_row("replica-b")
    assert 'id="outbox-warning-no-leader"' in viewer_client.get(DASHBOARD).content.decode()
    HarvesterStatus.objects.all().delete()
    page = viewer_client.get(DASHBOARD).content.decode()
    assert 'id="outbox-warning-no-harvester"' in page and "No harvester is running" in page


def test_dashboard_warns_when_two_replicas_claim_to_lead(viewer_client):
    status_row("replica-a", ReplicaState.LEADER, leader_id=uuid.uuid4())
    status_row("replica-b", ReplicaState.LEADER, leader_id=uuid.uuid4())
    status_row("other-app", ReplicaState.LEADER, leader_id=uuid.uuid4(), group="other")  # another group: fine
    page = viewer_client.get(DASHBOARD).content.decode()
    assert "More than one replica claims to lead group &#x27;g&#x27; (replica-a, replica-b)" in page


def test_dashboard_shows_which_replica_leads_which_shard_and_warns_of_a_shard_without_one(viewer_client):
    status_row("replica-a", shards=3)  # the sharded replica's own row: in the group
    status_row("replica-a-s0", ReplicaState.LEADER, leader_id=uuid.uuid4(), shard=0, shards=3)
    status_row("replica-a-s1", ReplicaState.LEADER, leader_id=uuid.uuid4(), shard=1, shards=3)
    page = viewer_client.get(DASHBOARD).content.decode()
    assert "<h2>Leaders</h2>" in page and '<td class="leader-shard">1 of 3</td>' in page
    assert "leader of shard 0 of 3" in page and "in the group (3 shards;" in page
    assert "More than one replica claims" not in page, "two leaders of two shards are not two leaders of one"
    alarm = re.search(r'id="outbox-warning-shard-no-leader">([^<]*)<', page)
    assert alarm and "has 3 shards and no live replica leads shard 2" in alarm.group(1).replace("&#x27;", "'")
    status_row("replica-b-s2", ReplicaState.LEADER, leader_id=uuid.uuid4(), shard=2, shards=3, host="host-b")
    status_row("replica-b-s1", ReplicaState.LEADER, leader_id=uuid.uuid4(), shard=1, shards=3, host="host-b")
    page = viewer_client.get(DASHBOARD).content.decode()
    assert "shard-no-leader" not in page
    assert "More than one replica claims to lead shard 1 of group &#x27;g&#x27; (replica-a-s1, replica-b-s1)" in page


def test_dashboard_beside_many_outboxes_judges_its_records_by_its_own_tables_terms(viewer_client):
    """A process harvesting many outboxes (tenant schemas) writes its engines' rows into the same status table:
    the console lists them all, warns of an outbox with no leader, and judges its own table's records by the
    terms of that table only (another table's ids say nothing of these)."""
    record = OutboxRecord.objects.create(kafka_topic="orders", kafka_key="order-1", kafka_value=b"{}")
    status_row("replica-a/tenants.acme", ReplicaState.LEADER, leader_id=uuid.uuid4(), marked_upto=record.id + 1000,
               held=[held_record(record.id, "order-1")], group="acme", table="acme.outbox")
    status_row("replica-b/tenants.acme", group="acme", table="acme.outbox")
    status_row("replica-b/shop", table="outbox")
    status_row("replica-b/tenants.globex", group="globex", table="globex.outbox")
    assert Facts.read().state_of(record).state is RecordState.WAITING, "not in flight, nor held, by acme's term"
    page = viewer_client.get(DASHBOARD).content.decode().replace("&#x27;", "'")
    assert "replica-a/tenants.acme" in page and "acme.outbox / acme" in page
    others = re.findall(r'<tr class="other-outbox[^"]*"><td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td>', page)
    assert others == [("acme.outbox", "acme", "replica-a/tenants.acme"), ("globex.outbox", "globex", "none")]
    assert "<p>No replica leads.</p>" in page and "<code class=\"in-flight-key\">" not in page, \
        "acme's leader is not this table's"
    alarms = re.findall(r'id="outbox-warning-outbox-no-leader">([^<]*)<', page)
    assert alarms == ["Outbox outbox has a live standby in group 'g' and no leader: its records are not published "
                      "(an election may be under way).",
                      "Outbox globex.outbox has a live standby in group 'globex' and no leader: its records are "
                      "not published (an election may be under way)."]
    status_row("replica-a/shop", ReplicaState.LEADER, leader_id=uuid.uuid4(), marked_upto=record.id, table="outbox")
    assert Facts.read().state_of(record).state is RecordState.IN_FLIGHT
    page = viewer_client.get(DASHBOARD).content.decode()
    assert page.count('id="outbox-warning-outbox-no-leader"') == 1
    assert re.findall(r'<td class="leader-name">([^<]*)</td>', page) == ["replica-a/shop"]


def test_dashboard_raises_the_fence_alarm_for_a_blocked_replica(viewer_client):
    status_row("replica-a", ReplicaState.LEADER, leader_id=uuid.uuid4())
    status_row("replica-b", ReplicaState.BLOCKED, group="billing", blocked_by=FENCE_HOLDER)
    page = viewer_client.get(DASHBOARD).content.decode()
    alarm = re.search(r'<li class="error outbox-warning" id="outbox-warning-fence">([^<]*)</li>', page)
    assert alarm, "a red warning names the fence"
    text = alarm.group(1).replace("&#x27;", "'")
    assert text.startswith("Two leader groups harvest one table (outbox): replica replica-b leads its group billing")
    assert FENCE_HOLDER in text and "publishes nothing while blocked" in text
    assert "same leader_topic and leader_group" in text
    assert f"blocked by {FENCE_HOLDER}" in page, "the replicas table says it too"
    assert "No replica leads" not in page


def test_dashboard_counts_in_flight_queued_held_and_parked(superuser_client):
    leader_id = uuid.uuid4()
    bad = poison("order-9", leader_id)
    status_row("replica-a", ReplicaState.LEADER, leader_id=leader_id, in_flight_keys=["order-1", "order-2"],
               queued=7, held=[held_record(bad.id, "order-9")])
    DeadLetter.objects.create(outbox_id=1, create_time=timezone.now(), kafka_topic="orders", kafka_key="order-0",
                              reason="Broker: Message size too large", attempts=3, parked_by="harvester replica-a")
    page = superuser_client.get(DASHBOARD).content.decode()
    figure = dict(re.findall(r'id="backlog-([a-z-]+)">([^<]*)<', page))
    assert (figure["rows"], figure["in-flight"], figure["queued"], figure["held"], figure["parked"]) == (
        "1", "2", "7", "1", "1")
    assert f'href="{PARKED}" id="parked-link"' in page


def test_dashboard_lists_held_records_with_reason_attempts_and_what_waits_behind(superuser_client):
    leader_id = uuid.uuid4()
    bad, gone = poison("order-9", leader_id), poison("order-8", leader_id)
    status_row("replica-a", ReplicaState.LEADER, leader_id=leader_id, held=[
        held_record(bad.id, "order-9", attempts=3, held_for=400, behind=1000, more_behind=True),
        held_record(gone.id, "order-8")])
    gone.delete()  # the leader notices within a second; the page does not wait for its next status row
    page = superuser_client.get(DASHBOARD).content.decode()
    held = page.split('id="held"')[1].split('id="in-flight-keys"')[0]
    assert f'value="{bad.id}"' in held and "<code>order-9</code>" in held
    assert "Broker: Message size too large" in held and "<td>3</td>" in held and "6\xa0minutes" in held
    assert '<td class="held-behind">1000, and more in the table</td>' in held
    assert "order-8" not in held, "a held record whose row is gone is not listed"
    assert 'id="retry-button"' in held and 'id="park-button"' in held


def test_dashboard_lists_stuck_records_but_not_held_or_waiting_behind_ones(superuser_client):
    live_id = uuid.uuid4()
    bad = poison("order-9", live_id)
    record("in-flight")
    flying = record("slow", age=3600)
    # The live leader has read up to here; the rest it has not read yet.
    status_row("replica-a", ReplicaState.LEADER, leader_id=live_id, marked_upto=flying.id,
               held=[held_record(bad.id, "order-9")])
    record("fresh")
    old = record("ancient", age=3600)
    failing = record("failing", resets=5, error="Local: Message timed out")
    record("order-9", age=3600)  # behind the held record, however old
    page = superuser_client.get(DASHBOARD).content.decode()
    stuck = page.split('id="stuck"')[1]
    assert re.findall(r'class="stuck-select" aria-label="select record (\d+)"', stuck) == [
        str(flying.id), str(old.id), str(failing.id)]
    assert "waiting, written 1\xa0hour ago" in stuck and "in flight, written 1\xa0hour ago" in stuck
    assert "delivery failed 5 times: Local: Message timed out" in stuck


# -- the records changelist ---------------------------------------------------------------------------

def test_records_changelist_shows_and_filters_every_state(superuser_client):
    live_id = uuid.uuid4()
    bad = poison("held-key", live_id)
    flying = record("flying-key")
    behind = record("held-key")
    status_row("replica-a", ReplicaState.LEADER, leader_id=live_id, marked_upto=behind.id,
               held=[held_record(bad.id, "held-key")])
    waiting = record("waiting-key")
    orphan = record("orphan-key")
    old = record("stuck-key", age=3600)
    failed = record("failed-key", resets=3, error="Local: Message timed out")
    other = OutboxRecord.objects.create(kafka_topic="payments", kafka_key="pay-1")

    assert changelist(superuser_client) == {
        bad.id: ("held-key", "held"), waiting.id: ("waiting-key", "waiting"), orphan.id: ("orphan-key", "waiting"),
        flying.id: ("flying-key", "in flight"), behind.id: ("held-key", f"waiting behind #{bad.id}"),
        old.id: ("stuck-key", "stuck"), failed.id: ("failed-key", "stuck"), other.id: ("pay-1", "waiting")}
    assert set(changelist(superuser_client, "state=waiting")) == {waiting.id, orphan.id, other.id}
    assert set(changelist(superuser_client, "state=in_flight")) == {flying.id}
    assert set(changelist(superuser_client, "state=held")) == {bad.id}
    assert set(changelist(superuser_client, "state=behind")) == {behind.id}
    assert set(changelist(superuser_client, "state=stuck")) == {old.id, failed.id}
    assert changelist_keys(superuser_client, "topic=payments") == {"pay-1"}
    assert changelist_keys(superuser_client, "q=flying-key") == {"flying-key"}
    filters = superuser_client.get(RECORDS).content.decode().split('id="changelist-filter"')[1]
    for label in ("waiting", "in flight", "held", "waiting behind", "stuck"):
        assert f">{label}</a>" in filters


def test_records_are_read_only_and_say_their_state(superuser_client):
    row = record("k", value="hello", headers=[("trace", "abc"), ("trace", "def")])
    detail = superuser_client.get(f"{RECORDS}{row.id}/change/").content.decode()
    assert "hello" in detail and "<code>trace</code>: <code>abc</code>" in detail
    assert "not read by a live leader yet" in detail
    assert 'name="_save"' not in detail
    assert "outbox/admin.css" in detail  # a long value without spaces wraps in its box
    assert superuser_client.post(f"{RECORDS}{row.id}/change/", {"kafka_key": "x"}).status_code == 403
    assert superuser_client.get(f"{RECORDS}add/").status_code == 403
    tombstone = record("t", value=None)
    assert "a tombstone" in superuser_client.get(f"{RECORDS}{tombstone.id}/change/").content.decode()
    huge = record("h", value="x" * 25_000)
    page = superuser_client.get(f"{RECORDS}{huge.id}/change/").content.decode()
    assert "x" * 10_000 + "... (the first 10,000 of 25,000 characters)" in page and "x" * 10_001 not in page


# -- actions ----------------------------------------------------------------------------------------

def test_confirmation_pages_follow_the_admin_templates(superuser_client):
    live_id = uuid.uuid4()
    bad = poison("order-9", live_id)
    status_row("replica-a", ReplicaState.LEADER, leader_id=live_id, held=[held_record(bad.id, "order-9")])
    for action in ("retry_selected", "park_selected", "requeue_selected"):
        page = superuser_client.post(RECORDS, {"action": action, "_selected_action": [bad.id], "index": 0})
        html = page.content.decode()
        assert page.status_code == 200 and BREADCRUMBS in html
        assert '<a role="button" href="#" class="button cancel-link">No, take me back</a>' in html
        assert not re.search(r"<button[^>]*>[^<]*<a", html), "no link inside a button"
        assert "admin/js/cancel.js" in html
    dashboard = superuser_client.get(DASHBOARD).content.decode()
    assert BREADCRUMBS in dashboard and NOT_BREADCRUMBS not in dashboard


def test_retry_now_asks_first_then_touches_the_held_row_and_logs_it(superuser_client):
    live_id = uuid.uuid4()
    bad = poison("order-9", live_id)
    status_row("replica-a", ReplicaState.LEADER, leader_id=live_id, held=[held_record(bad.id, "order-9")])
    form = {"action": "retry_selected", "_selected_action": [bad.id], "index": 0}
    confirmation = superuser_client.post(RECORDS, form)
    assert b"Retry held records now?" in confirmation.content and b"alone" in confirmation.content
    assert OutboxRecord.objects.get(pk=bad.pk).last_error == "Broker: Message size too large", "asks first"
    done = superuser_client.post(RECORDS, {**form, "post": "yes"}, follow=True)
    assert messages(done) == [("success", f"Asked the leader to retry 1 record: #{bad.id}.")]
    bad.refresh_from_db()
    assert bad.last_error.startswith("retry requested by root at ")
    entry = LogEntry.objects.get(object_id=str(bad.id))
    assert entry.action_flag == CHANGE and "Retry now" in entry.get_change_message()


def test_retry_now_and_park_leave_records_that_are_not_held_alone(superuser_client):
    live_id = uuid.uuid4()
    flying = record("a")
    status_row("replica-a", ReplicaState.LEADER, leader_id=live_id, marked_upto=flying.id)
    waiting = record("b")
    for action, nothing in (("retry_selected", "Nothing retried"), ("park_selected", "Nothing parked")):
        done = superuser_client.post(RECORDS, {"action": action, "_selected_action": [flying.id, waiting.id],
                                               "post": "yes"}, follow=True)
        assert messages(done) == [("warning", f"{nothing}: #{flying.id}, #{waiting.id} are not held by a live "
                                              f"leader (released or published meanwhile).")]
    assert OutboxRecord.objects.filter(last_error__isnull=False).count() == 0
    assert not DeadLetter.objects.exists() and not LogEntry.objects.exists()


def test_park_asks_first_then_moves_the_held_row_to_the_dead_letter_table_and_logs_it(superuser_client):
    live_id = uuid.uuid4()
    bad = poison("order-9", live_id)
    status_row("replica-a", ReplicaState.LEADER, leader_id=live_id,
               held=[held_record(bad.id, "order-9", attempts=4, behind=2)])
    form = {"action": "park_selected", "_selected_action": [bad.id], "index": 0}
    confirmation = superuser_client.post(RECORDS, form).content.decode()
    assert "Park held records?" in confirmation and "order is broken at that record" in confirmation
    assert OutboxRecord.objects.filter(pk=bad.pk).exists(), "asks first"
    done = superuser_client.post(RECORDS, {**form, "post": "yes"}, follow=True)
    assert messages(done) == [("success", f"Parked 1 record: #{bad.id}.")]
    assert not OutboxRecord.objects.filter(pk=bad.pk).exists()
    parked = DeadLetter.objects.get(outbox_id=bad.id)
    assert (parked.kafka_key, parked.kafka_value, parked.reason, parked.attempts, parked.parked_by,
            parked.dead_letter_topic) == ("order-9", "x" * 2000, "Broker: Message size too large", 4, "admin root",
                                          None)
    assert parked.create_time == bad.create_time
    entry = LogEntry.objects.get(object_id=str(parked.id))
    assert entry.action_flag == ADDITION and f"Parked outbox record #{bad.id}" in entry.get_change_message()


def test_parked_records_admin_republishes_after_saying_plainly_where_it_goes(superuser_client):
    parked = DeadLetter.objects.create(outbox_id=7, create_time=timezone.now() - timedelta(days=1),
                                       kafka_topic="orders", kafka_key="order-9", kafka_value="fixed",
                                       kafka_header_keys=["trace"], kafka_header_values=["abc"],
                                       reason="Broker: Message size too large", attempts=3, parked_by="admin root")
    later = record("order-9")
    listing = superuser_client.get(PARKED).content.decode()
    assert "order-9" in listing and "admin root" in listing and "republish_selected" in listing
    form = {"action": "republish_selected", "_selected_action": [parked.id], "index": 0}
    confirmation = superuser_client.post(PARKED, form).content.decode()
    assert "Republish parked records?" in confirmation
    assert "with a new id" in confirmation and "AFTER the records of its key written since" in confirmation
    assert DeadLetter.objects.filter(pk=parked.pk).exists(), "asks first"
    done = superuser_client.post(PARKED, {**form, "post": "yes"}, follow=True)
    back = OutboxRecord.objects.exclude(pk=later.pk).get(kafka_key="order-9")
    assert messages(done) == [("success", f"Republished 1 record: #7. Back in the outbox as #{back.id} (was #7).")]
    assert not DeadLetter.objects.filter(pk=parked.pk).exists()
    assert back.id > later.id and (back.kafka_value, back.headers) == ("fixed", [("trace", "abc")])
    assert back.create_time > parked.create_time
    entry = LogEntry.objects.get(object_id=str(back.id))
    assert entry.action_flag == ADDITION and f"Republished parked record #{parked.id} (outbox record #7)" in \
        entry.get_change_message()


def test_requeue_says_one_true_thing(superuser_client):
    live_id = uuid.uuid4()
    bad = poison("order-9", live_id)
    flying = record("in-flight")
    status_row("replica-a", ReplicaState.LEADER, leader_id=live_id, marked_upto=flying.id,
               held=[held_record(bad.id, "order-9")])
    orphan = record("orphaned", resets=4, error="timed out")
    form = {"action": "requeue_selected", "_selected_action": [flying.id, bad.id], "index": 0}
    confirmation = superuser_client.post(RECORDS, form)
    assert confirmation.status_code == 200 and b"Requeue outbox records?" in confirmation.content
    nothing = superuser_client.post(RECORDS, {**form, "post": "yes"}, follow=True)
    assert messages(nothing) == [("warning", f"Nothing requeued: #{bad.id} is held by the leader (use Retry now or "
                                             f"Park); #{flying.id} is read by the live leader (it may be in "
                                             f"flight).")]
    some = superuser_client.post(RECORDS, {**form, "_selected_action": [orphan.id, flying.id], "post": "yes"},
                                 follow=True)
    assert messages(some) == [("warning", f"Requeued 1 of 2 records (#{orphan.id}); #{flying.id} is read by the "
                                          f"live leader (it may be in flight).")]
    orphan.refresh_from_db()
    assert (orphan.reset_count, orphan.last_error) == (0, None)
    assert LogEntry.objects.get(object_id=str(orphan.id)).action_flag == CHANGE
    assert not LogEntry.objects.filter(object_id=str(flying.id)).exists()
    all_done = superuser_client.post(RECORDS, {**form, "_selected_action": [orphan.id], "post": "yes"}, follow=True)
    assert messages(all_done) == [("success", f"Requeued 1 record: #{orphan.id}.")]


def test_dashboard_actions_come_back_to_the_dashboard(superuser_client):
    live_id = uuid.uuid4()
    bad = poison("order-9", live_id)
    status_row("replica-a", ReplicaState.LEADER, leader_id=live_id, held=[held_record(bad.id, "order-9")])
    confirmation = superuser_client.post(RECORDS, {"action": "retry_selected", "_selected_action": [bad.id],
                                                   "index": 0, "next": DASHBOARD}).content.decode()
    assert f'<input type="hidden" name="next" value="{DASHBOARD}">' in confirmation
    done = superuser_client.post(RECORDS, {"action": "retry_selected", "_selected_action": [bad.id], "post": "yes",
                                           "next": DASHBOARD})
    assert done.status_code == 302 and done.url == DASHBOARD
    elsewhere = superuser_client.post(RECORDS, {"action": "retry_selected", "_selected_action": [bad.id],
                                                "post": "yes", "next": "https://evil.example/"})
    assert elsewhere.status_code == 302 and elsewhere.url == RECORDS


def test_delete_asks_first_then_deletes_and_logs_it(superuser_client):
    doomed, kept = record("doomed"), record("kept")
    form = {"action": "delete_selected", "_selected_action": [doomed.id], "index": 0}
    confirmation = superuser_client.post(RECORDS, form)
    assert confirmation.status_code == 200 and b"Are you sure" in confirmation.content
    assert OutboxRecord.objects.filter(pk=doomed.pk).exists()
    superuser_client.post(RECORDS, {**form, "post": "yes"})
    assert not OutboxRecord.objects.filter(pk=doomed.pk).exists() and OutboxRecord.objects.filter(pk=kept.pk).exists()
    assert LogEntry.objects.get(object_id=str(doomed.id)).action_flag == DELETION


# -- permissions ------------------------------------------------------------------------------------

def test_staff_without_permissions_sees_neither_the_dashboard_nor_records(staff_client):
    live_id = uuid.uuid4()
    bad = poison("order-9", live_id)
    status_row("replica-a", ReplicaState.LEADER, leader_id=live_id, held=[held_record(bad.id, "order-9")])
    response = staff_client.get(DASHBOARD)
    assert response.status_code == 403 and b"order-9" not in response.content
    assert staff_client.get(RECORDS).status_code == 403 and staff_client.get(PARKED).status_code == 403
    assert b"/admin/outbox/dashboard/" not in staff_client.get("/admin/").content, "not offered on the index"


def test_viewers_see_the_dashboard_without_buttons(viewer_client):
    live_id = uuid.uuid4()
    bad = poison("order-9", live_id)
    status_row("replica-a", ReplicaState.LEADER, leader_id=live_id, held=[held_record(bad.id, "order-9")])
    record("ancient", age=3600)
    page = viewer_client.get(DASHBOARD).content.decode()
    assert "order-9" in page and "ancient" in page
    for button in ("retry-button", "park-button", "requeue-button", "delete-button", "parked-link"):
        assert button not in page


def test_viewers_cannot_act(staff_client):
    user = User.objects.get(username="staff")
    user.user_permissions.add(*Permission.objects.filter(codename__in=["view_outboxrecord", "view_deadletter"]))
    live_id = uuid.uuid4()
    bad = poison("order-9", live_id)
    status_row("replica-a", ReplicaState.LEADER, leader_id=live_id, held=[held_record(bad.id, "order-9")])
    parked = DeadLetter.objects.create(outbox_id=7, create_time=timezone.now(), kafka_topic="orders",
                                       kafka_key="order-1", reason="r", parked_by="admin root")
    for action in ("retry_selected", "park_selected", "requeue_selected"):
        response = staff_client.post(RECORDS, {"action": action, "_selected_action": [bad.id], "post": "yes"},
                                     follow=True)
        assert response.status_code == 200
    staff_client.post(PARKED, {"action": "republish_selected", "_selected_action": [parked.id], "post": "yes"})
    bad.refresh_from_db()
    assert bad.last_error == "Broker: Message size too large" and DeadLetter.objects.count() == 1
    assert not LogEntry.objects.exists()
    changelist = staff_client.get(RECORDS).content.decode()
    assert "retry_selected" not in changelist and "park_selected" not in changelist
    assert "republish_selected" not in staff_client.get(PARKED).content.decode()
    assert "retry-button" not in staff_client.get(DASHBOARD).content.decode()


def test_republishing_needs_both_removing_the_parked_record_and_adding_to_the_outbox(staff_client):
    user = User.objects.get(username="staff")
    user.user_permissions.add(*Permission.objects.filter(codename__in=["view_deadletter", "delete_deadletter"]))
    assert "republish_selected" not in staff_client.get(PARKED).content.decode()
    user.user_permissions.add(Permission.objects.get(codename="add_outboxrecord"))
    assert "republish_selected" in staff_client.get(PARKED).content.decode()


# -- with commits: NOTIFY, Kafka, the configured database -------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_retry_and_park_wake_the_leader_with_a_notify(superuser_client, database_url):
    live_id = uuid.uuid4()
    first, second = poison("order-8", live_id), poison("order-9", live_id)
    status_row("replica-a", ReplicaState.LEADER, leader_id=live_id,
               held=[held_record(first.id, "order-8"), held_record(second.id, "order-9")])
    with psycopg.connect(database_url, autocommit=True) as listener:
        oid = listener.execute("SELECT to_regclass('outbox')::oid::bigint").fetchone()[0]
        listener.execute(f'LISTEN "{notify_channel(oid)}"')
        for action, record_id in (("retry_selected", first.id), ("park_selected", second.id)):
            superuser_client.post(RECORDS, {"action": action, "_selected_action": [record_id], "post": "yes"})
            heard = list(listener.notifies(timeout=5, stop_after=1))
            assert [n.channel for n in heard] == [notify_channel(oid)], f"{action} sends a NOTIFY"


@pytest.mark.django_db(transaction=True)
def test_park_also_publishes_to_the_dead_letter_topic(superuser_client, settings, new_topic, bootstrap_servers):
    from confluent_kafka import Consumer

    topic = new_topic("dead-letters", partitions=1)
    settings.OUTBOX = {**settings.OUTBOX, "dead_letter_topic": topic}
    live_id = uuid.uuid4()
    bad = record("order-9", resets=2, error="Broker: Message size too large",
                 headers=[("trace", "abc")], value="poison")
    status_row("replica-a", ReplicaState.LEADER, leader_id=live_id, held=[held_record(bad.id, "order-9")])
    done = superuser_client.post(RECORDS, {"action": "park_selected", "_selected_action": [bad.id], "post": "yes"},
                                 follow=True)
    assert messages(done) == [("success", f"Parked 1 record: #{bad.id}. Also published to dead-letter topic "
                                          f"{topic}.")]
    assert DeadLetter.objects.get(outbox_id=bad.id).dead_letter_topic == topic
    consumer = Consumer({"bootstrap.servers": bootstrap_servers, "group.id": f"t-{uuid.uuid4().hex[:8]}",
                         "auto.offset.reset": "earliest"})
    try:
        consumer.subscribe([topic])
        message = next(m for m in iter(lambda: consumer.poll(1.0), object()) if m is not None and not m.error())
    finally:
        consumer.close()
    assert (message.key(), message.value()) == (b"order-9", b"poison")
    headers = {k: v.decode() for k, v in message.headers()}
    assert headers["trace"] == "abc" and headers["outbox-id"] == str(bad.id) and headers["outbox-topic"] == "orders"
    assert headers["outbox-dead-letter-reason"] == "Broker: Message size too large"


@pytest.mark.django_db(transaction=True)
def test_park_says_when_the_dead_letter_topic_cannot_be_reached(superuser_client, settings):
    settings.OUTBOX = {**settings.OUTBOX, "dead_letter_topic": "dead-letters",
                       "base_kafka_config": {"bootstrap.servers": "127.0.0.1:1"}, "heartbeat_timeout": 0.5}
    live_id = uuid.uuid4()
    bad = poison("order-9", live_id)
    status_row("replica-a", ReplicaState.LEADER, leader_id=live_id, held=[held_record(bad.id, "order-9")])
    done = superuser_client.post(RECORDS, {"action": "park_selected", "_selected_action": [bad.id], "post": "yes"},
                                 follow=True)
    [(level, text)] = messages(done)
    assert level == "warning" and text.startswith(f"Parked 1 record: #{bad.id}. Publishing #{bad.id} to dead-letter "
                                                  f"topic dead-letters failed (")
    assert text.endswith("): parked in the dead-letter table only.")
    assert DeadLetter.objects.get(outbox_id=bad.id).dead_letter_topic is None


@pytest.fixture
def second_alias():
    """A second DATABASES alias for the same test database, as OUTBOX["database"] may name. Its
    connection is made, then the alias leaves `connections.settings`: Django's test case lets
    such dynamically created connections through, where it would refuse a configured alias it
    was not told of."""
    connections.settings["outbox_db"] = {**connections["default"].settings_dict}
    connection = connections["outbox_db"]
    del connections.settings["outbox_db"]
    yield "outbox_db"
    connection.close()
    del connections["outbox_db"]


@pytest.mark.django_db(transaction=True)
def test_the_admin_reads_the_configured_database(superuser_client, settings, second_alias):
    settings.OUTBOX = {**settings.OUTBOX, "database": second_alias}
    live_id = uuid.uuid4()
    bad = poison("order-9", live_id)
    status_row("replica-a", ReplicaState.LEADER, leader_id=live_id, held=[held_record(bad.id, "order-9")])
    record("ancient", age=3600)
    outbox_tables = re.compile(r'"outbox(_harvester|_dead_letter)?"')
    for url in (DASHBOARD, RECORDS, f"{RECORDS}?state=stuck", f"{RECORDS}{bad.id}/change/", PARKED):
        with CaptureQueriesContext(connections["default"]) as default, \
                CaptureQueriesContext(connections[second_alias]) as configured:
            assert superuser_client.get(url).status_code == 200
        assert not [q["sql"] for q in default.captured_queries if outbox_tables.search(q["sql"])], url
        assert any(outbox_tables.search(q["sql"]) for q in configured.captured_queries), url
