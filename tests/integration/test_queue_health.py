"""`manage.py outbox_queue_health`: queue processes judged by their status rows, as a probe beside them would."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from outbox.queue.models import QueueProcess
from tests.support.commands import manage

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def row(name: str, kind: str = "consumer", *, queue: str = "emails", seen: float = 0.0, host: str = "host-a",
        waiting: dict[str, object] | None = None) -> None:
    now = timezone.now()
    QueueProcess.objects.create(name=name, kind=kind, queue=queue if kind == "consumer" else "", host=host, pid=1,
                                started=now - timedelta(hours=1), last_seen=now - timedelta(seconds=seen),
                                stats={"waiting": waiting})


def health(database_url: str, *flags: str) -> tuple[int, str]:
    result = manage("outbox_queue_health", *flags, env={"DATABASE_URL": database_url})
    assert not result.stderr.strip(), result.stderr
    assert len(result.stdout.splitlines()) == 1, result.stdout
    return result.returncode, result.stdout.strip()


def test_a_process_waiting_past_the_stall_bound_is_unhealthy_and_a_short_wait_is_not(database_url):
    row("c1", waiting={"for": "Kafka's brokers", "seconds": 4.0})
    row("t1", "tracker")
    assert health(database_url, "--any") == (0, "ok: 2 live queue process(es), 1 waiting for Kafka (for less than 25s)")
    QueueProcess.objects.filter(name="c1").update(stats={"waiting": {"for": "Kafka's brokers", "seconds": 40.0}})
    code, line = health(database_url, "--any")
    assert code == 1 and re.fullmatch(r"unhealthy: consumer c1 of queue emails has waited 4\ds for Kafka's brokers, "
                                      r"handling nothing \(stalled after 25s\)", line), line
    assert health(database_url, "--kind", "tracker", "--host", "host-a") == (
        0, "ok: 1 live tracker(s) on host 'host-a'")


def test_no_live_process_in_scope_is_unhealthy(database_url):
    row("c1", seen=300)
    code, line = health(database_url, "--queue", "emails", "--any")
    assert code == 1, line
    assert line.startswith("unhealthy: no live queue process(es) of queue 'emails' (c1 last seen 30"), line
    assert health(database_url, "--name", "never") == (1, "unhealthy: no live queue process(es) named 'never' "
                                                          "(never seen)")


def test_an_unreachable_database_is_one_line():
    result = manage("outbox_queue_health", "--any", env={"DATABASE_URL": "postgres://outbox:outbox@127.0.0.1:1/outbox"})
    assert result.returncode == 1 and result.stdout.startswith("unhealthy: cannot read queue status:"), result.stdout
