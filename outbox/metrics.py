"""Prometheus metrics for a running harvester: `manage.py harvest --metrics-port 9108`.

Counters and histograms are fed by the engine's Instruments hooks; gauges are read from the
Harvester when Prometheus scrapes, so the engine pays nothing between scrapes. What harvesting costs
the database, by kind of statement (outbox.harvest.dbtime): every replica counts its own round trips
(`outbox_database_seconds_total`); the leader also exports the server's own time for the table's
statements, as its status reporter last read them from pg_stat_statements
(`outbox_database_server_seconds_total`). The two gauges the
harvester does not know, parked records (the dead-letter table's count, outbox.states) and the age of
the oldest row (the primary key's head), are read at scrape time too. Alert rules and a Grafana
dashboard over these metrics are in monitoring/.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from outbox import metrics_endpoint
from outbox.harvest.contract import ReplicaState
from outbox.harvest.dbtime import ROUND_TRIP_KINDS, SERVER_KINDS
from outbox.harvest.harvester import Harvester
from outbox.harvest.instruments import Instruments
from outbox.harvest.outboxes import ManyHarvester
from outbox.harvest.shards import ShardedHarvester

log = logging.getLogger("outbox.metrics")

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class PrometheusInstruments(Instruments):
    """Mark and purge latency, and resets, as Prometheus metrics in `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.mark_seconds = Histogram("outbox_mark_seconds", "Mark query latency", buckets=LATENCY_BUCKETS,
                                      registry=registry)
        self.purge_seconds = Histogram("outbox_purge_seconds", "Purge (batched DELETE) latency",
                                       buckets=LATENCY_BUCKETS, registry=registry)
        self.marked_records = Counter("outbox_records_marked", "Rows marked", registry=registry)
        self.reset_records = Counter("outbox_records_reset", "Rows reset after a failed delivery", registry=registry)
        self.database_seconds = Counter("outbox_database_seconds", "Time this replica waited on the database, by kind "
                                        "of statement (round trips)", ["statement"], registry=registry)
        self.database_round_trips = Counter("outbox_database_round_trips", "Database round trips, by kind of "
                                            "statement", ["statement"], registry=registry)
        for kind in ROUND_TRIP_KINDS:  # every kind is there from the start, at 0
            self.database_seconds.labels(kind)
            self.database_round_trips.labels(kind)

    def marked(self, seconds: float, rows: int) -> None:
        self.mark_seconds.observe(seconds)
        self.marked_records.inc(rows)

    def purged(self, seconds: float, rows: int) -> None:
        self.purge_seconds.observe(seconds)

    def reset(self, rows: int) -> None:
        self.reset_records.inc(rows)

    def database(self, kind: str, seconds: float, rows: int) -> None:
        self.database_seconds.labels(kind).inc(seconds)
        self.database_round_trips.labels(kind).inc()


class HarvesterCollector(Collector):
    """Reads the harvester's state at scrape time."""

    def __init__(self, harvester: Harvester | ShardedHarvester | ManyHarvester,
                 parked: Callable[[], int | None] | None = None, oldest_age: Callable[[], float | None] | None = None,
                 horizon: Callable[[], Any] | None = None) -> None:
        self._harvester = harvester
        self._parked = parked
        self._oldest_age = oldest_age
        self._horizon = horizon

    def _engines(self) -> list[tuple[Harvester, list[str]]]:
        """Each engine of this replica with its labels (name, outbox, shard): the harvester itself (shard ""),
        a sharded replica's engine for each shard it has now, or each outbox's engine(s) of a process harvesting
        several (`outbox` is then the outbox's label, `shop` or `tenants.acme`: two databases' tables may share
        a name, and series of one name and labels would collide; `name` is the process's)."""
        h = self._harvester
        if isinstance(h, ManyHarvester):
            found: list[tuple[Harvester, list[str]]] = []
            for label, engine in sorted(h.engines.items()):
                if isinstance(engine, ShardedHarvester):
                    found += [(each, [h.name, label, str(shard)]) for shard, each in sorted(engine.engines.items())]
                elif isinstance(engine, Harvester):
                    found.append((engine, [h.name, label, ""]))
            return found
        replica = [h.config.name, h.config.table]
        if isinstance(h, ShardedHarvester):
            return [(engine, [*replica, str(shard)]) for shard, engine in sorted(h.engines.items())]
        return [(h, [*replica, ""])]

    def collect(self) -> Iterator[Any]:
        h = self._harvester
        engines = self._engines()
        per_engine = ["name", "outbox", "shard"]

        def family(kind: type, metric: str, text: str, value: Callable[[Harvester], float]) -> Any:
            found = kind(metric, text, labels=per_engine)
            for engine, engine_labels in engines:
                found.add_metric(engine_labels, value(engine))
            return found

        yield family(CounterMetricFamily, "outbox_records_published", "Records published and purged",
                     lambda e: e.published)
        yield family(CounterMetricFamily, "outbox_records_failed", "Records whose delivery failed", lambda e: e.failed)
        yield family(GaugeMetricFamily, "outbox_in_flight_records", "Records sent and not yet purged",
                     lambda e: e.in_flight_records)
        leader = GaugeMetricFamily("outbox_leader_state", "1 for this replica's (with shards: each of its shard "
                                   "engines') current state", labels=[*per_engine, "state"])
        states = [(engine_labels, engine.status().state) for engine, engine_labels in engines]
        if isinstance(h, ShardedHarvester) and not states:  # in the group, with no shard now
            states = [([h.config.name, h.config.table, ""], h.replica_state)]
        for engine_labels, state in states:
            for candidate in ReplicaState:
                leader.add_metric([*engine_labels, candidate.value], 1.0 if state is candidate else 0.0)
        yield leader
        if isinstance(h, ManyHarvester):
            yield from self._collect_many(h, engines)
            return
        replica = [h.config.name, h.config.table]
        labels = ["name", "outbox"]
        if isinstance(h, ShardedHarvester):
            shards = GaugeMetricFamily("outbox_shards", "Shards of this replica's group", labels=labels)
            shards.add_metric(replica, h.config.shards)
            yield shards
            led = GaugeMetricFamily("outbox_shards_led", "Shards this replica leads", labels=labels)
            led.add_metric(replica, len(h.leading_shards))
            yield led
        yield family(GaugeMetricFamily, "outbox_held_records", "Records held by this leader: they fail on their own, "
                                                               "and their keys wait", lambda e: len(e.held))
        parked_records = self._parked() if self._parked is not None else None
        if parked_records is not None:
            parked = GaugeMetricFamily("outbox_parked_records", "Records in the dead-letter table (parked)",
                                       labels=labels)
            parked.add_metric(replica, parked_records)
            yield parked
        age = self._oldest_age() if self._oldest_age is not None else None
        if age is not None:
            oldest = GaugeMetricFamily("outbox_oldest_record_age_seconds", "Age of the oldest row in the outbox (0 "
                                                                           "when it is empty)", labels=labels)
            oldest.add_metric(replica, age)
            yield oldest
        leading = [(e, shard, e.database_statements) for e, (*_, shard) in engines
                   if e.status().state is ReplicaState.LEADER]
        leading = [(e, shard, statements) for e, shard, statements in leading if statements is not None][:1]
        if leading:  # the table's statements, whoever ran them: one leading engine exports them
            statements = leading[0][2]
            seconds = CounterMetricFamily("outbox_database_server_seconds", "Postgres's execution time of the "
                                          "table's statements, by kind, since its statistics were reset "
                                          "(pg_stat_statements; all replicas; exported by the leader)",
                                          labels=[*labels, "statement"])
            calls = CounterMetricFamily("outbox_database_server_calls", "Executions of the table's statements, by "
                                        "kind (pg_stat_statements; exported by the leader)",
                                        labels=[*labels, "statement"])
            for kind in SERVER_KINDS:
                found = statements.get(kind, (0, 0.0, 0))
                seconds.add_metric([*replica, kind], found[1])
                calls.add_metric([*replica, kind], found[0])
            yield seconds
            yield calls
        held = self._horizon() if self._horizon is not None else None
        if held is not None:
            age = GaugeMetricFamily("outbox_horizon_age_seconds", "How long the oldest transaction (or prepared "
                                    "transaction) has held the database's horizon back: vacuum cannot remove dead "
                                    "rows meanwhile", labels=labels)
            age.add_metric(replica, held.age)
            yield age
            dead = GaugeMetricFamily("outbox_dead_rows", "Dead rows in the outbox table (Postgres's statistics)",
                                     labels=labels)
            dead.add_metric(replica, held.dead_rows)
            yield dead
        backlog_rows = next((e.backlog for e, _ in engines if e.backlog is not None), None)
        if backlog_rows is not None:
            backlog = GaugeMetricFamily("outbox_backlog_records", "Rows in the outbox (Postgres's live-row estimate)",
                                        labels=labels)
            backlog.add_metric(replica, backlog_rows)
            yield backlog


    def _collect_many(self, h: ManyHarvester, engines: list[tuple[Harvester, list[str]]]) -> Iterator[Any]:
        """What a process harvesting several outboxes adds per outbox: whether its engine runs and how often it
        failed, held records and backlog (the figures read from the model's table, parked records and the
        oldest row's age, are one outbox's: not here)."""
        up = GaugeMetricFamily("outbox_engine_up", "1 while the outbox's engine runs in this process; 0 while it "
                               "waits to be started again after a failure", labels=["name", "outbox"])
        failures = CounterMetricFamily("outbox_engine_failures", "Times the outbox's engine failed to start or "
                                       "failed running (each is started again after a backoff)",
                                       labels=["name", "outbox"])
        for label, (running, failed) in sorted(h.engine_health.items()):
            up.add_metric([h.name, label], 1.0 if running else 0.0)
            failures.add_metric([h.name, label], failed)
        yield up
        yield failures
        held = GaugeMetricFamily("outbox_held_records", "Records held by this leader: they fail on their own, and "
                                 "their keys wait", labels=["name", "outbox", "shard"])
        backlog = GaugeMetricFamily("outbox_backlog_records", "Rows in the outbox (Postgres's live-row estimate)",
                                    labels=["name", "outbox"])
        seen: set[str] = set()
        for engine, engine_labels in engines:
            held.add_metric(engine_labels, len(engine.held))
            if engine.backlog is not None and engine_labels[1] not in seen:
                seen.add(engine_labels[1])
                backlog.add_metric(engine_labels[:2], engine.backlog)
        yield held
        yield backlog


def serve(harvester: Harvester | ShardedHarvester | ManyHarvester, registry: CollectorRegistry, port: int,
          address: str = "0.0.0.0", *, parked: Callable[[], int | None] | None = None,
          oldest_age: Callable[[], float | None] | None = None, horizon: Callable[[], Any] | None = None) -> int:
    """Expose `registry` plus the harvester's gauges on http://address:port/metrics, and say which port (EndpointFailure
    when it cannot); the readers of what the harvester does not know are the entry point's (manage.py harvest's read
    Django's database, outbox/metrics_readers.py; outbox-harvest's read it by psycopg)."""
    registry.register(HarvesterCollector(harvester, parked=parked, oldest_age=oldest_age, horizon=horizon))
    return metrics_endpoint.start(port, address, registry)
