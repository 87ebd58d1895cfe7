"""How the status rows are sorted for the health probe and the dashboard (outbox.harvest.replicas)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

from outbox.console.dashboard import warnings
from outbox.harvest import replicas
from outbox.harvest.contract import ReplicaState
from outbox.harvest.replicas import LATER_COLUMNS, Replicas

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def row(name: str, state: ReplicaState, *, since: float, seen: float, shard: int | None = None,
        group: str = "g") -> Any:
    """A status row: leader (or not) since `since` seconds ago, last written `seen` seconds ago."""
    return SimpleNamespace(**{**LATER_COLUMNS, "name": name, "host": "h", "state": str(state), "leader_group": group,
                              "harvested_table": "outbox", "since": NOW - timedelta(seconds=since),
                              "last_seen": NOW - timedelta(seconds=seen), "throughput": 0.0, "in_flight": 0,
                              "shard": shard, "shards": 1 if shard is None else 2})


def test_a_leader_not_seen_since_another_took_its_lead_is_gone_at_once():
    """A killed leader writes no last row: once its successor's row says it leads, the killed one is gone, not a
    second leader for `status_gone_after` seconds."""
    killed = row("a", ReplicaState.LEADER, since=600, seen=8)
    found = Replicas.sort([killed, row("b", ReplicaState.LEADER, since=5, seen=0.5)], NOW, 20.0)
    assert [r.name for r in found.leaders] == ["b"] and found.gone == [killed] and found.superseded == [killed]
    assert not [alarm for alarm in warnings(found) if alarm.kind == "two-leaders"]
    healthy, why = replicas.health(found, NOW, name="a")
    assert not healthy and "a last seen 8s ago, before another replica took its lead" in why, why


def test_two_leaders_that_both_write_after_the_newer_took_over_are_two_leaders():
    found = Replicas.sort([row("a", ReplicaState.LEADER, since=600, seen=0.5),
                           row("b", ReplicaState.LEADER, since=5, seen=0.5)], NOW, 20.0)
    assert [r.name for r in found.leaders] == ["a", "b"] and not found.gone
    assert [alarm.kind for alarm in warnings(found)] == ["two-leaders"]


def test_only_a_leader_of_the_same_group_and_shard_supersedes_one():
    rows = [row("a-s0", ReplicaState.LEADER, since=600, seen=8, shard=0),
            row("b-s1", ReplicaState.LEADER, since=5, seen=0.5, shard=1),
            row("c", ReplicaState.LEADER, since=600, seen=8, group="other"),
            row("d", ReplicaState.STANDBY, since=5, seen=0.5, group="other")]
    found = Replicas.sort(rows, NOW, 20.0)
    assert [r.name for r in found.leaders] == ["a-s0", "b-s1", "c"] and not found.gone


def test_a_leader_is_not_superseded_by_its_own_clock():
    """`since` is the replica's clock, `last_seen` the database's: a lone leader whose host runs ahead stays one,
    and so does one whose successor took over less than the clocks' slack after its last row."""
    found = Replicas.sort([row("a", ReplicaState.LEADER, since=-30, seen=3)], NOW, 20.0)
    assert [r.name for r in found.leaders] == ["a"]
    found = Replicas.sort([row("a", ReplicaState.LEADER, since=600, seen=3.5),
                           row("b", ReplicaState.LEADER, since=3, seen=0.5)], NOW, 20.0)
    assert [r.name for r in found.leaders] == ["a", "b"]
