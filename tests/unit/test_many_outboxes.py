"""Many outboxes in one process, with fakes: the supervisor (outbox/harvest/outboxes.py), the shared
LISTEN session's dispatch (notify_hub.py), tenant discovery (tenants.py) and OUTBOX["outboxes"] (many.py).

The real SQL and a real LISTEN session are tested in tests/integration/test_many_outboxes.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
from collections import deque
from typing import Any

import pytest
from django.test import override_settings

from outbox import conf, many, settings_problems
from outbox.harvest import discovery
from outbox.harvest.config import HarvestConfig
from outbox.harvest.contract import ReplicaState
from outbox.harvest.harvester import Harvester, HarvestError, State
from outbox.harvest.notify_hub import NotifyHub, NotifyHubs
from outbox.harvest.outboxes import ManyHarvester
from outbox.harvest.supervisor import MAX_BACKOFF, RESTART_BACKOFF
from outbox.harvest.tenants import find_tenant_tables
from tests.support import waiting

# ---------------------------------------------------------------------------------------------- the supervisor


class FakeEngine:
    """An engine that runs until stopped, or fails when told to."""

    def __init__(self, label: str, config: HarvestConfig, *, refuse: bool = False) -> None:
        self.label, self.config, self.refuse = label, config, refuse
        self.state = State.CREATED
        self.replica_state = ReplicaState.STANDBY
        self.published = 0
        self.failure: str | None = None
        #: Whether stop() leaves it STOPPING (settling what it has in flight) until the test stops it.
        self.settles = False

    def start(self) -> None:
        if self.refuse:
            raise HarvestError(f"table {self.config.table!r} does not exist")
        self.state = State.RUNNING

    def stop(self) -> None:
        self.state = State.STOPPING if self.settles else State.STOPPED

    def fail(self, why: str) -> None:
        self.failure, self.state = why, State.STOPPED

    def wait(self, timeout: float | None = None) -> bool:
        if self.failure is not None:
            raise HarvestError(f"harvester failed: {self.failure}")
        return self.state is State.STOPPED


class World:
    """What discover() finds, a clock the test moves, and every engine the supervisor built."""

    def __init__(self, *labels: str) -> None:
        self.found = {label: self.config(label) for label in labels}
        self.now = 1000.0
        self.built: list[FakeEngine] = []
        self.refusing: set[str] = set()
        self.discovery_fails = False

    @staticmethod
    def config(label: str, **changes: Any) -> HarvestConfig:
        return HarvestConfig(dsn="dbname=x", table=f"{label}.outbox", name=f"replica/{label}",
                             leader_topic=f"leader-{label}", leader_group=f"leader-{label}", **changes)

    def discover(self) -> dict[str, HarvestConfig]:
        if self.discovery_fails:
            raise OSError("connection refused")
        return dict(self.found)

    def factory(self, label: str, config: HarvestConfig) -> FakeEngine:
        engine = FakeEngine(label, config, refuse=label in self.refusing)
        self.built.append(engine)
        return engine

    def supervisor(self, rescan: float = 30.0) -> ManyHarvester:
        harvester = ManyHarvester(self.discover, name="replica", rescan_interval=rescan, engine_factory=self.factory,
                                  clock=lambda: self.now)
        return harvester

    def running(self, harvester: ManyHarvester) -> dict[str, FakeEngine]:
        return {label: engine for label, engine in harvester.engines.items() if engine.state is State.RUNNING}


def started(world: World, harvester: ManyHarvester) -> ManyHarvester:
    """Discover and take the first look, as start() and the supervisor's first tick do, without its thread."""
    harvester._wanted = world.discover()
    harvester._next_scan = world.now + harvester._rescan_interval
    harvester.tick()
    return harvester


def test_each_outbox_found_gets_an_engine_of_its_own():
    world = World("acme", "globex")
    harvester = started(world, world.supervisor())
    running = world.running(harvester)
    assert sorted(running) == ["acme", "globex"]
    assert running["acme"].config.table == "acme.outbox" and running["globex"].config.leader_group == "leader-globex"
    harvester.tick()
    assert len(world.built) == 2, "a running engine is not started twice"


def test_a_schema_created_while_running_is_picked_up_at_the_next_rescan_and_a_dropped_one_stopped():
    world = World("acme", "globex")
    harvester = started(world, world.supervisor(rescan=30.0))
    world.found["initech"] = World.config("initech")
    del world.found["globex"]
    globex = harvester.engines["globex"]
    world.now += 29.0
    harvester.tick()
    assert sorted(world.running(harvester)) == ["acme", "globex"], "not before the rescan is due"
    world.now += 1.0
    harvester.tick()
    assert sorted(world.running(harvester)) == ["acme", "initech"]
    assert globex.state is State.STOPPED
    harvester.tick()
    assert sorted(harvester.engines) == ["acme", "initech"], "a stopped engine of a gone outbox is forgotten"


def test_a_failed_engine_starts_again_after_a_backoff_that_doubles_and_the_others_go_on():
    world = World("acme", "globex")
    harvester = started(world, world.supervisor())
    acme_engines = []
    for backoff in (RESTART_BACKOFF, 2 * RESTART_BACKOFF, 4 * RESTART_BACKOFF):
        engine = harvester.engines["acme"]
        acme_engines.append(engine)
        engine.fail("Kafka went away")
        harvester.tick()
        assert "acme" not in harvester.engines
        world.now += backoff - 0.01
        harvester.tick()
        assert "acme" not in harvester.engines, f"not before {backoff}s"
        world.now += 0.01
        harvester.tick()
        assert world.running(harvester)["acme"] is not engine, "a fresh engine"
        assert world.running(harvester)["globex"] is world.built[1], "the other outbox's engine was never touched"
    # One that ran for MAX_BACKOFF before failing is a new failure: the backoff starts again.
    world.now += MAX_BACKOFF
    harvester.engines["acme"].fail("Kafka went away")
    harvester.tick()
    world.now += RESTART_BACKOFF
    harvester.tick()
    assert "acme" in world.running(harvester)


def test_an_outbox_whose_engine_cannot_start_is_tried_again_and_the_backoff_is_capped():
    world = World("acme", "broken")
    world.refusing.add("broken")
    harvester = started(world, world.supervisor(rescan=10_000.0))
    assert sorted(world.running(harvester)) == ["acme"]
    attempts = []
    for _ in range(12):
        before = len(world.built)
        world.now += MAX_BACKOFF
        harvester.tick()
        attempts.append(len(world.built) - before)
    assert attempts == [1] * 12, "at most MAX_BACKOFF between two attempts, and one attempt each time"
    # The metrics say so: an engine failing in a loop has no engine most of the time, and no other series.
    from prometheus_client import CollectorRegistry, generate_latest

    from outbox.metrics import HarvesterCollector

    registry = CollectorRegistry()
    registry.register(HarvesterCollector(harvester))
    text = generate_latest(registry).decode()
    assert 'outbox_engine_up{name="replica",outbox="broken"} 0.0' in text
    assert 'outbox_engine_failures_total{name="replica",outbox="broken"} 13.0' in text
    assert 'outbox_engine_up{name="replica",outbox="acme"} 1.0' in text
    world.refusing.clear()
    world.now += MAX_BACKOFF
    harvester.tick()
    assert sorted(world.running(harvester)) == ["acme", "broken"]
    assert harvester.engine_health == {"acme": (True, 0), "broken": (True, 13)}


def test_an_outbox_whose_config_changed_gets_a_fresh_engine():
    world = World("acme")
    harvester = started(world, world.supervisor(rescan=1.0))
    old = harvester.engines["acme"]
    world.found["acme"] = World.config("acme", shards=4)
    world.now += 1.0
    harvester.tick()  # the old one is asked to stop (it settles first)...
    assert old.state is State.STOPPED
    harvester.tick()  # ...and once stopped, a new one starts with the new config
    assert world.running(harvester)["acme"].config.shards == 4


def test_a_fresh_engine_waits_until_the_old_one_of_its_outbox_settled():
    # Two engines of one outbox in one process would be two publishers of it until the old one stopped.
    world = World("acme")
    harvester = started(world, world.supervisor(rescan=1.0))
    old = harvester.engines["acme"]
    old.settles = True
    world.found["acme"] = World.config("acme", shards=4)
    for _ in range(5):
        world.now += 1.0
        harvester.tick()
        assert old.state is State.STOPPING and len(world.built) == 1, "no second engine while the first settles"
    old.state = State.STOPPED
    harvester.tick()
    assert world.running(harvester)["acme"].config.shards == 4 and len(world.built) == 2


def test_when_discovery_fails_the_outboxes_found_before_go_on_and_it_is_said_once(caplog):
    world = World("acme")
    harvester = started(world, world.supervisor(rescan=1.0))
    world.discovery_fails = True
    with caplog.at_level(logging.WARNING, logger="outbox.harvest.outboxes"):
        for _ in range(3):
            world.now += 1.0
            harvester.tick()
    assert sorted(world.running(harvester)) == ["acme"]
    assert caplog.text.count("Cannot look for outboxes") == 1
    assert "connection refused" in caplog.text


def test_start_fails_in_one_line_when_the_first_discovery_fails():
    world = World()
    world.discovery_fails = True
    with pytest.raises(HarvestError, match="cannot find the outboxes to harvest: connection refused"):
        world.supervisor().start()


def test_a_stop_during_the_first_discovery_starts_nothing():
    world = World("acme")
    harvester = world.supervisor()
    found = world.discover

    def discover() -> dict[str, HarvestConfig]:
        harvester.stop()  # a SIGTERM while the first discovery runs
        return found()

    harvester._discover = discover
    harvester.start()
    assert harvester.wait(0) and harvester.state is State.STOPPED, "stopped by the time start() returned"
    assert world.built == [] and harvester._manager is None


def test_stop_ends_the_set_once_every_engine_settled():
    world = World("acme", "globex")
    harvester = world.supervisor()
    assert harvester.open()  # start() without its manager thread: the test steps what the thread runs
    harvester.tick()
    assert sorted(world.running(harvester)) == ["acme", "globex"]
    assert harvester.replica_state is ReplicaState.STANDBY
    world.built[0].settles = True
    harvester.stop()  # a SIGTERM: the manager's loop ends, then its end steps
    assert not harvester.end_step() and harvester.state is State.STOPPING and not harvester.wait(0)
    assert [engine.state for engine in world.built] == [State.STOPPING, State.STOPPED]
    world.built[0].state = State.STOPPED
    assert harvester.end_step() and harvester.wait(0) and harvester.state is State.STOPPED


def test_the_real_engine_runs_under_the_supervisor_with_fakes():
    from outbox.harvest.fakes import FakeConnector

    connectors: dict[str, FakeConnector] = {}

    def factory(label: str, config: HarvestConfig) -> Harvester:
        connectors[label] = FakeConnector()
        return Harvester(config, connector=connectors[label])

    world = World("acme", "globex")
    # Two databases' outboxes whose tables have one name: their series must not collide.
    world.found = {label: dataclasses.replace(config, table="outbox", dsn=f"dbname={label}")
                   for label, config in world.found.items()}
    harvester = ManyHarvester(world.discover, engine_factory=factory, name="replica")
    harvester.start()
    try:
        wait_for(lambda: sorted(harvester.leading) == ["acme", "globex"], "each outbox led by its engine", timeout=20)
        assert harvester.replica_state is ReplicaState.LEADER
        # Its metrics carry each outbox's label as the `outbox` label (tables of two databases may share a name).
        from prometheus_client import CollectorRegistry, generate_latest

        from outbox.metrics import HarvesterCollector

        registry = CollectorRegistry()
        registry.register(HarvesterCollector(harvester))
        text = generate_latest(registry).decode()
        for label in ("acme", "globex"):
            assert f'outbox_leader_state{{name="replica",outbox="{label}",shard="",state="leader"}} 1.0' in text
            assert f'outbox_records_published_total{{name="replica",outbox="{label}",shard=""}}' in text
    finally:
        harvester.stop()
        assert harvester.wait(timeout=20), "stopped within 20 s"


# ---------------------------------------------------------------------------------------------- the shared LISTEN


class FakeNotify:
    def __init__(self, channel: str) -> None:
        self.channel = channel


class FakeSession:
    """A LISTEN session: the statements it ran, and NOTIFYs the test delivers through a pipe (its socket)."""

    def __init__(self) -> None:
        self.statements: list[str] = []
        self._read, self._write = os.pipe()
        self._pending: deque[str] = deque()
        self._lock = threading.Lock()
        self.closed = False
        self.broken = False

    def fileno(self) -> int:
        return self._read

    def execute(self, statement: Any) -> None:
        if self.broken:
            import psycopg

            raise psycopg.OperationalError("server closed the connection unexpectedly")
        self.statements.append(statement.as_string(None) if hasattr(statement, "as_string") else str(statement))

    def deliver(self, *channels: str) -> None:
        with self._lock:
            self._pending.extend(channels)
        os.write(self._write, b"\0")

    def notifies(self, timeout: float = 0) -> list[FakeNotify]:
        os.set_blocking(self._read, False)
        try:
            os.read(self._read, 4096)
        except BlockingIOError:
            pass
        if self.broken:
            import psycopg

            raise psycopg.OperationalError("server closed the connection unexpectedly")
        with self._lock:
            found, self._pending = list(self._pending), deque()
        return [FakeNotify(channel) for channel in found]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self._write)
            os.close(self._read)


def wait_for(condition: Any, what: str, timeout: float = 5.0) -> None:
    waiting.wait_until(condition, timeout, what, interval=0.005)


def woken(listener: Any) -> int:
    """How many wakes the listener has, drained."""
    return 0 if listener.fileno() is None else listener.drain()


class Clock:
    """The hub's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def hub():
    """A hub stepped by the test (`hub.step()`), on a clock it moves (`hub.clock.now`): no thread, no wait."""
    sessions: list[FakeSession] = []

    def connect() -> FakeSession:
        sessions.append(FakeSession())
        return sessions[-1]

    clock = Clock()
    found = NotifyHub("dbname=x", connect=connect, clock=clock)
    found.sessions_made = sessions
    found.clock = clock
    yield found
    found.end()
    for session in sessions:
        session.close()


def test_a_notify_wakes_only_the_engine_of_the_table_that_was_written(hub):
    a, b = hub.subscribe("outbox_1"), hub.subscribe("outbox_2")
    hub.step()
    assert a.connected and b.connected
    session = hub.sessions_made[0]
    assert sorted(session.statements) == ['LISTEN "outbox_1"', 'LISTEN "outbox_2"'], "one session for both"
    woken(a), woken(b)  # the wake each gets when its channel starts being listened to
    session.deliver("outbox_2", "outbox_2", "outbox_3")
    hub.step()
    assert hub.received == 3, "the hub took the three NOTIFYs in"
    assert woken(b) >= 1, "b's table was written"
    assert woken(a) == 0, "a's was not"


def test_a_listener_is_woken_once_its_channel_is_listened_to(hub):
    listener = hub.subscribe("outbox_7")
    assert listener.fileno() is not None and not listener.connected, "a pipe at once, no LISTEN yet"
    assert woken(listener) == 0
    hub.step()
    assert listener.connected
    assert woken(listener) >= 1, "woken once: a NOTIFY before the LISTEN would have been lost"
    hub.step()
    assert woken(listener) == 0, "once"


def test_while_no_session_can_be_had_every_engine_is_woken_at_each_attempt(caplog):
    import psycopg

    from outbox.harvest.notify_hub import RETRY_AFTER

    clock = Clock()
    attempts = []

    def connect() -> FakeSession:
        attempts.append(clock.now)
        raise psycopg.OperationalError("connection refused")

    hub = NotifyHub("dbname=x", connect=connect, clock=clock)
    a, b = hub.subscribe("outbox_1"), hub.subscribe("outbox_2")
    with caplog.at_level(logging.WARNING, logger="outbox.harvest.notify_hub"):
        try:
            for _ in range(4):
                hub.step()
                assert woken(a) >= 1 and woken(b) >= 1, "each engine looks at its table instead"
                hub.step()
                clock.now += RETRY_AFTER / 2
                hub.step()
                assert woken(a) == 0, "not again before the next attempt"
                clock.now += RETRY_AFTER / 2
        finally:
            hub.end()
    assert len(attempts) == 4 and all(later - earlier == RETRY_AFTER
                                      for earlier, later in itertools.pairwise(attempts)), "every RETRY_AFTER"
    assert caplog.text.count("LISTEN session unavailable") == 1, "said once"


def test_a_session_that_refuses_listen_is_tried_again_after_a_backoff_and_the_engines_are_woken(caplog):
    # A hot standby accepts the connection and refuses LISTEN: opening sessions in a loop would wake nobody.
    from outbox.harvest.notify_hub import RETRY_AFTER

    clock = Clock()
    sessions: list[FakeSession] = []

    def connect() -> FakeSession:
        sessions.append(FakeSession())
        sessions[-1].broken = True
        return sessions[-1]

    hub = NotifyHub("dbname=x", connect=connect, clock=clock)
    a = hub.subscribe("outbox_1")
    with caplog.at_level(logging.WARNING, logger="outbox.harvest.notify_hub"):
        try:
            for tried in range(1, 5):
                hub.step()
                hub.step()
                assert len(sessions) == tried, "no second session before RETRY_AFTER"
                assert woken(a) >= 1, "the engine looks at its table instead"
                clock.now += RETRY_AFTER
        finally:
            hub.end()
            for session in sessions:
                session.close()
    assert caplog.text.count("LISTEN session unavailable") == 1, "said once"
    assert not a.connected


def test_a_listener_closed_is_unlistened_and_the_others_stay(hub):
    a, b = hub.subscribe("outbox_1"), hub.subscribe("outbox_2")
    hub.step()
    assert hub.channels == {"outbox_1", "outbox_2"}
    a.close()
    hub.step()
    assert hub.channels == {"outbox_2"}
    assert 'UNLISTEN "outbox_1"' in hub.sessions_made[0].statements
    assert b.connected


def test_two_engines_of_one_table_share_its_channel(hub):
    first, second = hub.subscribe("outbox_1"), hub.subscribe("outbox_1")
    hub.step()
    assert first.connected and second.connected
    woken(first), woken(second)
    hub.sessions_made[0].deliver("outbox_1")
    hub.step()
    assert woken(first) >= 1 and woken(second) >= 1
    first.close()
    hub.step()
    assert hub.channels == {"outbox_1"}, "still listened to for the other"
    assert hub.sessions_made[0].statements == ['LISTEN "outbox_1"']


def test_after_the_session_is_lost_every_engine_is_woken_on_the_next_one(hub):
    from outbox.harvest.notify_hub import RETRY_AFTER

    a, b = hub.subscribe("outbox_1"), hub.subscribe("outbox_2")
    hub.step()
    woken(a), woken(b)
    hub.clock.now += RETRY_AFTER  # the session has lived a while: it is opened again at once
    first = hub.sessions_made[0]
    first.broken = True
    first.deliver("outbox_1")  # the socket says something: the session is found broken
    hub.step()
    assert hub.channels == frozenset() and not a.connected, "nothing listened to without a session"
    hub.step()
    assert len(hub.sessions_made) == 2 and hub.channels == {"outbox_1", "outbox_2"}, "a new session"
    assert sorted(hub.sessions_made[1].statements) == ['LISTEN "outbox_1"', 'LISTEN "outbox_2"']
    assert woken(a) >= 1 and woken(b) >= 1, "both woken: a NOTIFY may have been lost meanwhile"


def test_a_process_has_one_hub_per_database_ended_by_its_last_listener():
    sessions: dict[str, list[FakeSession]] = {}

    def connect(dsn: str) -> FakeSession:
        sessions.setdefault(dsn, []).append(FakeSession())
        return sessions[dsn][-1]

    hubs = NotifyHubs(connect=connect, threads=False)

    def step() -> None:
        for each in hubs.running:
            each.step()

    a, b, other = (hubs.subscribe("db1", "outbox_1"), hubs.subscribe("db1", "outbox_2"),
                   hubs.subscribe("db2", "outbox_1"))
    try:
        step()
        assert a.connected and b.connected and other.connected
        assert [len(sessions["db1"]), len(sessions["db2"])] == [1, 1], "one session per database"
        [first, _] = hubs.running
        a.close()
        step()
        assert hubs.running[0] is first and b.connected, "b still listens on db1's hub"
        b.close()
        assert [hub.dsn for hub in hubs.running] == ["db2"], "db1's hub ended with its last listener"
        assert sessions["db1"][0].closed and first.channels == frozenset(), "its session is gone"
        again = hubs.subscribe("db1", "outbox_1")
        step()
        assert again.connected and len(sessions["db1"]) == 2 and woken(again) >= 1, "a new hub listening"
        again.close()
    finally:
        other.close()
        for found in sessions.values():
            for session in found:
                session.close()
    assert hubs.running == []


# ---------------------------------------------------------------------------------------------- tenant discovery


class FakeCatalog:
    """The catalog query's answer: each schema's table and its oid (by default, its position in the first list)."""

    def __init__(self, schemas: list[str]) -> None:
        self.schemas = schemas
        self.oids = {schema: 16384 + i for i, schema in enumerate(schemas)}
        self.params: list[dict[str, Any]] = []

    def execute(self, statement: str, params: dict[str, Any]) -> FakeCatalog:
        self.params.append(params)
        return self

    def fetchall(self) -> list[tuple[str, int]]:
        return [(schema, self.oids[schema]) for schema in self.schemas]

    def close(self) -> None:
        pass


def test_tenant_tables_are_each_schemas_table_minus_the_excluded(caplog):
    catalog = FakeCatalog(["acme", "globex", "public", "has space", "Mixed"])
    skipped: set[str] = set()
    with caplog.at_level(logging.WARNING, logger="outbox.harvest.tenants"):
        assert find_tenant_tables(catalog, "outbox", exclude={"public"}, skipped=skipped) == {
            "acme.outbox": 16384, "globex.outbox": 16385, "Mixed.outbox": 16388}
        find_tenant_tables(catalog, "outbox", exclude={"public"}, skipped=skipped)
    assert catalog.params[0] == {"table": "outbox"}
    assert caplog.text.count("'has space'") == 1, "a schema the engine cannot name is said once"


def test_a_tenant_table_created_again_is_left_out_of_one_scan_so_a_fresh_engine_names_it(monkeypatch, caplog):
    """Its engine's NOTIFY channel and fence name the old table's oid: it stops (left out), and the next scan
    starts a fresh one; a table dropped, then created later, is simply new."""
    catalog = FakeCatalog(["acme", "globex"])
    monkeypatch.setattr(discovery, "connect", lambda *args, **kwargs: catalog)
    with override_settings(OUTBOX={}):
        discover = many.discoverer(conf.harvest_config(name="r"), {"tenants": {"tenant_schemas": True}}, set())
    assert sorted(discover()) == ["tenants.acme", "tenants.globex"]
    catalog.oids["acme"] = 20000
    with caplog.at_level(logging.INFO, logger="outbox.harvest.outboxes"):
        assert sorted(discover()) == ["tenants.globex"], "acme's old engine stops"
    assert "table acme.outbox was created again" in caplog.text
    assert sorted(discover()) == ["tenants.acme", "tenants.globex"], "and a fresh one starts"
    assert sorted(discover()) == ["tenants.acme", "tenants.globex"]
    catalog.schemas = ["globex"]
    assert sorted(discover()) == ["tenants.globex"]
    catalog.schemas = ["acme", "globex"]
    catalog.oids["acme"] = 30000
    assert sorted(discover()) == ["tenants.acme", "tenants.globex"], "dropped, then created: new, at once"


def test_a_table_created_again_is_still_found_so_after_a_scan_that_failed_half_way(monkeypatch):
    catalog = FakeCatalog(["acme"])
    failing = {"second": False}
    calls = []

    def connect(*args: Any, **kwargs: Any) -> FakeCatalog:
        calls.append(len(calls))
        if failing["second"] and len(calls) % 2 == 0:
            raise RuntimeError("too many clients")
        return catalog

    monkeypatch.setattr(discovery, "connect", connect)
    entries = {"a": {"tenant_schemas": True}, "b": {"tenant_schemas": True, "table": "inbox"}}
    with override_settings(OUTBOX={}):
        discover = many.discoverer(conf.harvest_config(name="r"), entries, set())
    assert sorted(discover()) == ["a.acme", "b.acme"]
    catalog.oids["acme"] = 20000
    failing["second"] = True
    with pytest.raises(RuntimeError):
        discover()  # entry a's scan saw the new oid, entry b's failed: the whole scan is thrown away
    failing["second"] = False
    assert "a.acme" not in discover(), "the table created again is still told apart from the old one"


def test_the_tenant_table_must_be_unqualified():
    with pytest.raises(ValueError, match="must be unqualified"):
        find_tenant_tables(FakeCatalog([]), "acme.outbox")


# ---------------------------------------------------------------------------------------------- OUTBOX["outboxes"]


@pytest.mark.parametrize(("outboxes", "field", "message"), [
    ({}, "outboxes", "non-empty dict"),
    ({"shop": "outbox"}, "outboxes.shop", "must be a dict"),
    ({"shop": {"tabel": "x"}}, "outboxes.shop.tabel", "is not a key of an outbox"),
    ({"shop": {"database": "nope"}}, "outboxes.shop.database", "must name an entry of DATABASES"),
    ({"shop": {"table": "a b"}}, "outboxes.shop.table", "SQL identifier"),
    ({"t": {"tenant_schemas": True, "table": "s.outbox"}}, "outboxes.t.table", "unqualified"),
    ({"t": {"tenant_schemas": "yes"}}, "outboxes.t.tenant_schemas", "True or False"),
    ({"t": {"exclude_schemas": ["public"]}}, "outboxes.t.exclude_schemas", "only with tenant_schemas"),
    ({"t": {"tenant_schemas": True, "leader_topic": "x"}}, "outboxes.t.leader_topic", "derives its own"),
    ({"shop": {"shards": 0}}, "outboxes.shop.shards", "whole number"),
    ({"a/b": {}}, "outboxes.a/b", "must not contain '.' or '/'"),
    ({"a.b": {}}, "outboxes.a.b", "must not contain '.' or '/'"),
])
def test_a_bad_outboxes_entry_is_one_line_naming_it(outboxes, field, message):
    with override_settings(OUTBOX={"outboxes": outboxes}):
        found = [p for p in settings_problems.settings_problems() if p.code == "E018"]
    assert [p.field for p in found] == [field]
    assert message in found[0].message


def test_the_check_names_the_entry_and_key():
    from outbox.checks import describe

    with override_settings(OUTBOX={"outboxes": {"shop": {"tabel": "x"}}}):
        problem = next(p for p in settings_problems.settings_problems() if p.code == "E018")
        assert describe(problem).startswith("OUTBOX['outboxes']['shop']['tabel'] is not a key of an outbox")


def test_each_outbox_derives_its_own_leader_topic_and_group_and_engine_name():
    with override_settings(OUTBOX={"outboxes": {"shop": {}, "billing": {"table": "billing.outbox", "shards": 4},
                                                "named": {"leader_topic": "t", "leader_group": "g"}}}):
        base = conf.harvest_config(name="replica-a")
        entries = many.selected_entries(None)
        found = many.discoverer(base, entries, set())()
    assert sorted(found) == ["billing", "named", "shop"]
    shop, billing, named = found["shop"], found["billing"], found["named"]
    assert shop.table == "outbox" and billing.table == "billing.outbox" and billing.shards == 4
    assert shop.leader_group == conf.default_leader_name("default", "outbox") == shop.leader_topic
    assert billing.leader_group == conf.default_leader_name("default", "billing.outbox") != shop.leader_group
    assert (named.leader_topic, named.leader_group) == ("t", "g")
    assert [c.name for c in (shop, billing, named)] == ["replica-a/shop", "replica-a/billing", "replica-a/named"]
    assert all(not c.validate() for c in found.values())
    assert shop.limits.idle_poll_interval == many.MANY_IDLE_POLL_INTERVAL, "NOTIFY wakes it: a rare safety net"


def test_an_idle_poll_interval_set_is_kept():
    with override_settings(OUTBOX={"outboxes": {"shop": {}}, "idle_poll_interval": 2.5}):
        base = conf.harvest_config()
        found = many.discoverer(base, many.selected_entries(None), conf.build()[1])()
    assert found["shop"].limits.idle_poll_interval == 2.5


def test_outbox_picks_entries_and_tenant_schemas_adds_one():
    with override_settings(OUTBOX={"outboxes": {"shop": {}, "billing": {}}}):
        assert list(many.selected_entries(["billing"])) == ["billing"]
        assert sorted(many.selected_entries(None)) == ["billing", "shop"]
        assert many.selected_entries(None, tenant_schemas=True, table="outbox", exclude_schemas=["public"]) == {
            "tenants": {"tenant_schemas": True, "table": "outbox", "exclude_schemas": ["public"]}}
        with pytest.raises(ValueError, match=r"--outbox: no outbox named 'nope' .*there are: billing, shop"):
            many.selected_entries(["nope"])


def test_a_tenant_outbox_parks_in_its_own_schema():
    with override_settings(OUTBOX={}):
        base = conf.harvest_config(name="r")
        config = discovery.outbox_config(base, "tenants.acme", {"tenant_schemas": True}, "acme.outbox", set(),
                                         many.locate)
    assert config.dead_letter_table == "acme.outbox_dead_letter"
    assert config.status_table == base.status_table, "status rows stay in one table, where the dashboard reads"
    assert dataclasses.replace(config, name="x").validate() == []


# ---------------------------------------------------------------------------------------------- the status board


def test_an_engines_row_on_the_board_is_plain_json_with_what_a_status_row_says():
    import json
    import uuid
    from datetime import UTC, datetime

    from outbox.harvest.contract import HeldRecord
    from outbox.harvest.status import StatusSnapshot
    from outbox.harvest.status_board import BoardReporter, StatusBoards

    leader_id = uuid.uuid4()
    since = datetime(2026, 11, 25, 7, 0, tzinfo=UTC)
    held = HeldRecord(id=7, key="k", topic="t", reason="too large", attempts=2, held_for=1.5, behind=3,
                      more_behind=False)
    snapshot = StatusSnapshot(state=ReplicaState.LEADER, leader_id=leader_id, since=since, in_flight=2, queued=1,
                              in_flight_keys=["a", "b"], in_flight_key_count=2, held=[held], blocked_by=None,
                              throughput=3.5, published=10, failed=1, marked_upto=42)
    config = World.config("acme")
    reporter = BoardReporter(StatusBoards(), config=config, snapshot=lambda: snapshot, on_backlog=lambda rows: None)
    row = json.loads(json.dumps(reporter.row()))
    assert row["name"] == "replica/acme" and row["harvested_table"] == "acme.outbox"
    assert row["leader_group"] == "leader-acme" and row["state"] == "leader"
    assert row["leader_id"] == str(leader_id) and datetime.fromisoformat(row["since"]) == since
    assert row["held_keys"] == ["k: too large"] and row["held"] == [held.as_json()]
    assert (row["in_flight"], row["queued"], row["published"], row["failed"], row["marked_upto"]) == (2, 1, 10, 1, 42)
    assert reporter.table == '"acme"."outbox"', "as the backlog query matches it"


def test_one_board_per_status_table_for_a_replica_and_its_shards_ended_by_the_last_to_leave(monkeypatch):
    """A sharded replica's own row and its shards' engines' rows on one session: a shard's engine's row carries its
    shard and goes when it stops (its shard moved); the replica's row says stopped; the board then ends."""
    import dataclasses

    from outbox.harvest import status_board
    from outbox.harvest.config import Limits

    statements: list[str] = []
    sessions: list[FakeStatusConnection] = []

    def connect(*args: Any, **kwargs: Any) -> FakeStatusConnection:
        sessions.append(FakeStatusConnection(statements))
        return sessions[-1]

    monkeypatch.setattr(status_board, "connect", connect)
    replica = dataclasses.replace(World.config("acme", status_table="outbox_harvester_status",
                                               limits=Limits(history_interval=0.0, status_interval=60.0)), shards=2)
    boards = status_board.StatusBoards(name="replica", threads=False)
    own = boards.reporter(replica, a_snapshot, lambda rows: None, sharded_replica=True)
    engines = [boards.reporter(dataclasses.replace(replica.for_shard(shard), name=f"replica/acme/s{shard}"),
                               a_snapshot, lambda rows: None) for shard in (0, 1)]
    for reporter in (own, *engines):
        reporter.start()
    [board] = boards.running
    assert [own.shard, engines[0].shard, engines[1].shard] == [{"shard": None, "shards": 2},
                                                             {"shard": 0, "shards": 2}, {"shard": 1, "shards": 2}]
    assert [own.forget, engines[0].forget] == [False, True] and own.notes is not None and engines[0].notes is None
    board.step()
    assert any(s.startswith("INSERT INTO") for s in statements), "the rows written"
    engines[0].close(timeout=0)
    board.step()
    assert "DELETE FROM" in statements, "the moved shard's row is gone"
    assert boards.running == [board] and not sessions[0].closed
    statements.clear()
    engines[1].close(timeout=0)
    own.close(timeout=0)  # the last to leave: the board ends, writing their rows
    assert sorted(statements[:2]) == ["DELETE FROM", "UPDATE \"outbox_harvester_status\""], statements
    assert boards.running == [] and len(sessions) == 1 and sessions[0].closed, "the board ended with its last engine"


# ---------------------------------------------------------------------------------------------- manage.py harvest


@pytest.mark.parametrize(("args", "outboxes", "message"), [
    (["--exclude-schema", "public"], None, "--exclude-schema: applies only with --tenant-schemas"),
    (["--outbox", "nope"], {"shop": {}}, "--outbox: no outbox named 'nope' in OUTBOX['outboxes'] (there are: shop)"),
    (["--tenant-schemas", "--leader-topic", "t"], None, "--leader-topic: cannot be given with several outboxes"),
    (["--table", "other"], {"shop": {}}, "--table: with OUTBOX['outboxes'], each outbox names its own"),
    ([], {"shop": {"tabel": "x"}}, "outboxes.shop.tabel: is not a key of an outbox"),
])
def test_harvest_refuses_what_cannot_go_with_several_outboxes_in_one_line(args, outboxes, message):
    from django.core.management import CommandError, call_command

    with override_settings(OUTBOX={"outboxes": outboxes} if outboxes else {}), \
            pytest.raises(CommandError) as raised:
        call_command("harvest", *args)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def a_snapshot() -> Any:
    from datetime import UTC, datetime

    from outbox.harvest.status import StatusSnapshot

    return StatusSnapshot(state=ReplicaState.STANDBY, leader_id=None, since=datetime.now(UTC), in_flight=0, queued=0,
                          in_flight_keys=[], in_flight_key_count=0, held=[], blocked_by=None, throughput=0.0,
                          published=0, failed=0, marked_upto=None)


class FakeStatusConnection:
    """The board's session: each statement's first words, in order; `exists` answers to_regclass (and whether the
    shard columns are there)."""

    def __init__(self, log: list[str], exists: bool = True) -> None:
        self.log, self.exists, self.closed = log, exists, False

    def execute(self, statement: Any, params: Any = None) -> FakeStatusConnection:
        text = statement.as_string(None) if hasattr(statement, "as_string") else str(statement)
        self.log.append(" ".join(text.split()[:2]))
        self._answer = [(self.exists,)] if "to_regclass(%s) IS NOT NULL" in text or "pg_attribute" in text else []
        return self

    def fetchone(self) -> tuple[Any, ...] | None:
        return self._answer[0] if self._answer else None

    def fetchall(self) -> list[Any]:
        return self._answer

    def close(self) -> None:
        self.closed = True


def test_a_board_whose_database_cannot_say_at_first_is_started_and_writes_once_it_can(monkeypatch):
    import psycopg

    from outbox.harvest import status_board

    statements: list[str] = []
    sessions: list[FakeStatusConnection] = []
    answers = iter([psycopg.OperationalError("sorry, too many clients already")])

    def connect(*args: Any, **kwargs: Any) -> FakeStatusConnection:
        failure = next(answers, None)
        if failure is not None:
            raise failure
        sessions.append(FakeStatusConnection(statements))
        return sessions[-1]

    monkeypatch.setattr(status_board, "connect", connect)
    boards = status_board.StatusBoards(name="replica", threads=False)
    config = World.config("acme", status_table="outbox_harvester_status")
    reporter = boards.reporter(config, a_snapshot, lambda rows: None)
    try:
        assert reporter is not None, "one refused connection must not turn status rows off for good"
        reporter.start()
        assert boards.running == [reporter.board]
        reporter.board.step()
        assert any(s.startswith("INSERT INTO") for s in statements), "the engine's row written"
    finally:
        boards.close()


def test_a_missing_status_table_turns_rows_off_and_its_probe_session_is_closed(monkeypatch):
    from outbox.harvest import status_board

    sessions: list[FakeStatusConnection] = []

    def connect(*args: Any, **kwargs: Any) -> FakeStatusConnection:
        sessions.append(FakeStatusConnection([], exists=False))
        return sessions[-1]

    monkeypatch.setattr(status_board, "connect", connect)
    boards = status_board.StatusBoards(name="replica")
    assert boards.reporter(World.config("acme", status_table="outbox_harvester_status"), a_snapshot,
                           lambda rows: None) is None
    assert len(sessions) == 1 and sessions[0].closed


def test_an_engine_started_again_keeps_its_row_the_old_ones_stopped_is_written_first(monkeypatch):
    from outbox.harvest import status_board
    from outbox.harvest.config import Limits

    statements: list[str] = []
    monkeypatch.setattr(status_board, "connect", lambda *a, **k: FakeStatusConnection(statements))
    config = World.config("acme", status_table="outbox_harvester_status", limits=Limits(history_interval=0.0))
    board = status_board.StatusBoard(config, name="replica")
    boards = status_board.StatusBoards()
    old = status_board.BoardReporter(boards, config, a_snapshot, lambda rows: None)
    new = status_board.BoardReporter(boards, config, a_snapshot, lambda rows: None)
    board.attach(old)
    board._write()
    board.detach(old)
    board.attach(new)
    statements.clear()
    board._write()
    assert statements.index("UPDATE \"outbox_harvester_status\"") < statements.index("INSERT INTO"), statements
