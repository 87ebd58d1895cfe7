"""outbox.states: one definition of each record state, the same row by row (state_of) and in SQL (where)."""

from __future__ import annotations

import itertools
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from outbox import states
from outbox.harvest.contract import ReplicaState
from outbox.models import DeadLetter, OutboxRecord
from outbox.states import Facts, RecordState
from tests.support.status_rows import held_record, status_row

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


def test_every_row_is_in_exactly_the_state_its_filter_selects(settings):
    settings.OUTBOX = {**settings.OUTBOX, "stuck_after": 600, "stuck_reset_count": 3}
    live, gone_leader = uuid.uuid4(), uuid.uuid4()
    now = timezone.now()
    rows = []
    # Every combination of: key (held or not), read by the live leader or not, age, failures.
    for read, key, age, resets in itertools.product(
            [True, False], ["poisoned", "plain"], [0, 599, 601, 86400], [0, 2, 3, 9]):
        row = OutboxRecord.objects.create(kafka_topic="orders", kafka_key=key, kafka_value="v", reset_count=resets)
        OutboxRecord.objects.filter(pk=row.pk).update(create_time=now - timedelta(seconds=age))
        rows.append((row.pk, read))
    marked_upto = max(pk for pk, read in rows if read)
    held_id = rows[len(rows) // 8][0]  # a "poisoned" row among the read: some rows of its key are before it
    status_row("leader", ReplicaState.LEADER, leader_id=live, marked_upto=marked_upto,
               held=[held_record(held_id, "poisoned")])
    status_row("old-leader", ReplicaState.LEADER, leader_id=gone_leader, marked_upto=max(pk for pk, _ in rows),
               seen=600)

    facts = Facts.read()
    by_row = {r.id: facts.state_of(r).state for r in OutboxRecord.objects.all()}
    by_filter: dict[int, list[RecordState]] = {}
    for state in RecordState:
        for record_id in OutboxRecord.objects.filter(facts.where(state)).values_list("id", flat=True):
            by_filter.setdefault(record_id, []).append(state)
    assert {i: [s] for i, s in by_row.items()} == by_filter
    assert set(by_row.values()) == set(states.OUTBOX_STATES), "the rows cover every state"
    assert by_row[held_id] is RecordState.HELD
    assert all(s is RecordState.BEHIND for i, s in by_row.items()
               if i > held_id and OutboxRecord.objects.get(pk=i).kafka_key == "poisoned")


def test_what_each_state_says_about_a_row():
    live = uuid.uuid4()
    bad = OutboxRecord.objects.create(kafka_topic="t", kafka_key="k", reset_count=2,
                                      last_error="Broker: Message size too large")
    behind = OutboxRecord.objects.create(kafka_topic="t", kafka_key="k")
    sent = OutboxRecord.objects.create(kafka_topic="t", kafka_key="s")
    unread = OutboxRecord.objects.create(kafka_topic="t", kafka_key="o")
    failing = OutboxRecord.objects.create(kafka_topic="t", kafka_key="f", reset_count=3, last_error="timed out")
    status_row("leader", ReplicaState.LEADER, leader_id=live, marked_upto=sent.id,
               held=[held_record(bad.id, "k", attempts=2, held_for=120)])
    facts = Facts.read()
    held = facts.state_of(bad)
    assert (held.label, held.why) == ("held", "held: Broker: Message size too large (2 attempt(s), for 2\xa0minutes)")
    assert facts.state_of(behind).label == f"waiting behind #{bad.id}"
    assert facts.state_of(sent).why == "read by the live leader"
    assert facts.state_of(unread).why == "not read by a live leader yet"
    assert facts.state_of(failing).why == "delivery failed 3 times: timed out"


def test_a_blocked_or_standby_replica_has_nothing_in_flight():
    """Only a term (a leader id) has rows in flight; a leader between terms reports none."""
    status_row("blocked", ReplicaState.BLOCKED, blocked_by="replica a of leader group g on h (pid 1)")
    status_row("between-terms", ReplicaState.LEADER)
    row = OutboxRecord.objects.create(kafka_topic="t", kafka_key="k")
    facts = Facts.read()
    assert [r.name for r in facts.replicas.blocked] == ["blocked"]
    assert [r.name for r in facts.replicas.leaders] == ["between-terms"] and not facts.replicas.live_leader_ids
    assert facts.state_of(row).state is RecordState.WAITING


def test_parked_count_is_exact_when_small_and_bounded_when_large(monkeypatch):
    for i in range(3):
        DeadLetter.objects.create(outbox_id=i, create_time=timezone.now(), kafka_topic="t", kafka_key="k",
                                  reason="r", parked_by="admin root")
    assert states.parked_count() == states.Count(3, exact=True) and str(states.parked_count()) == "3"
    monkeypatch.setattr(states, "COUNT_LIMIT", 2)
    count = states.parked_count()
    assert not count.exact and count.value >= 3 and str(count).startswith("about ")
