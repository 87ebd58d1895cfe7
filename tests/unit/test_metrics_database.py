"""outbox.metrics: what harvesting costs the database, as Prometheus sees it."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from outbox.harvest.contract import ReplicaState
from outbox.harvest.dbtime import ROUND_TRIP_KINDS, SERVER_KINDS
from outbox.metrics import HarvesterCollector, PrometheusInstruments


def scraped(registry: CollectorRegistry) -> dict[str, float]:
    values = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("outbox_database"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def replica(state: ReplicaState, statements: dict | None) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(name="r1", table="outbox"), published=0, failed=0,
                           in_flight_records=0, held=[], backlog=None, status=lambda: SimpleNamespace(state=state),
                           database_statements=statements)


def test_round_trips_are_counted_by_kind_every_kind_from_zero():
    registry = CollectorRegistry()
    instruments = PrometheusInstruments(registry)
    instruments.database("purge", 0.002, 40)
    instruments.database("purge", 0.003, 10)
    values = scraped(registry)
    assert values['outbox_database_seconds_total{statement="purge"}'] == 0.005
    assert values['outbox_database_round_trips_total{statement="purge"}'] == 2
    assert all(values[f'outbox_database_round_trips_total{{statement="{kind}"}}'] == 0
               for kind in ROUND_TRIP_KINDS if kind != "purge")


def test_the_leader_exports_the_servers_time_and_a_standby_does_not():
    statements = {"mark": (10, 0.25, 1000), "writers": (10, 0.05, 0)}
    leader, standby = CollectorRegistry(), CollectorRegistry()
    leader.register(HarvesterCollector(replica(ReplicaState.LEADER, statements)))
    standby.register(HarvesterCollector(replica(ReplicaState.STANDBY, statements)))
    values = scraped(leader)
    assert values['outbox_database_server_seconds_total{name="r1",outbox="outbox",statement="mark"}'] == 0.25
    assert values['outbox_database_server_calls_total{name="r1",outbox="outbox",statement="writers"}'] == 10
    assert len([v for v in values if v.startswith("outbox_database_server_calls_total")]) == len(SERVER_KINDS)
    assert scraped(standby) == {}
    without = CollectorRegistry()
    without.register(HarvesterCollector(replica(ReplicaState.LEADER, None)))
    assert scraped(without) == {}, "no pg_stat_statements: no series rather than zeros"
