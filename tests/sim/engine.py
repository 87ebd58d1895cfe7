"""One engine in the simulated world: the production Harvester (its open(), its step(), stop(), wait(), its end),
over the world's I/O instead of runtime.ThreadedIO.

What is modelled here is the world around the Harvester, never its lifecycle: its engine thread (a world event
that runs `Harvester.step()` when it is due or woken, and stands still while its process is paused), its two
database sessions (one statement at a time, with a latency), its record producer (the memory broker's), the
admin requests that read topics' limits, the delivery thread that polls a retiring producer, and its election
thread (election_thread.py). A thread of the I/O that fails (`EngineHost.fail`) is what `ThreadedIO.failure()`
reports: the Harvester's next step ends the engine, closing what it opened, and its wait() re-raises.

The process around the engine (one table, a sharded replica, many outboxes) is the caller's: it gives the
engine its links, its pauses and crashes (`Process`).
"""

from __future__ import annotations

from collections.abc import Callable
from operator import methodcaller
from typing import Any, Protocol

from outbox.harvest import events
from outbox.harvest.config import HarvestConfig
from outbox.harvest.connector import Store
from outbox.harvest.contract import Record
from outbox.harvest.core import Core
from outbox.harvest.driver import Driver
from outbox.harvest.harvester import Harvester, HarvestError
from outbox.harvest.memory_table import MemoryStore, MemoryTable
from outbox.harvest.neli import Election, ElectionPoll
from outbox.harvest.producers import RecordProducers
from outbox.kafka.memory.broker import MemoryBroker, MemoryProducer
from outbox.kafka.memory.world import Violation
from outbox.kafka.sizes import UNLIMITED, batch_size_for
from tests.sim import election_thread
from tests.sim.election_thread import SimElectionThread

#: The engine whose turn runs now (a trace's log lines name it).
RUNNING: list[str] = [""]


class Process(election_thread.Process, Protocol):
    """What an engine reads of the process it runs in (its election thread reads the rest)."""

    kafka: MemoryBroker
    table: MemoryTable
    log: Any
    links: Any
    slow_until: float


class EngineFailed(Exception):
    """A thread of the engine's I/O died (a simulated failure)."""


class SimIO:
    """The driver's EngineIO in the simulated world, with runtime.ThreadedIO's life (open, start, failure, close,
    wake) as the Harvester calls it."""

    def __init__(self, host: EngineHost, announce: Callable[[events.Event], None]) -> None:
        self._host = host
        self._announce = announce
        self.driver: Driver | None = None
        self.election_thread: SimElectionThread | None = None
        self.topic_limits = None  # the Harvester's view of them (topics.TopicLimits) is the real I/O's only
        self.producers = RecordProducers(self._new_producer, UNLIMITED, self._retired)
        #: Topics' max.message.bytes as this replica last read them (the broker's `max_message_bytes`),
        #: read a moment after first asked for, again every topic_limits_interval and after a refusal.
        self._limits: dict[str, int] = {}
        self._reading: set[str] = set()

    def now(self) -> float:
        return self._host.world.now

    # -- life (ThreadedIO's) --------------------------------------------------------------------

    def open(self, driver: Driver) -> None:
        host = self._host
        self.driver = driver
        driver.wake = host.wake
        self.election_thread = SimElectionThread(host, host.election, driver.post, host.limits.min_poll_interval,
                                                 host.election_poll_class)

    def start(self) -> None:
        assert self.election_thread is not None
        self.election_thread.start()
        self._host.wake()

    def failure(self) -> BaseException | None:
        return self._host.failure

    def close(self) -> None:
        """The election thread stops (a revoke callback under way returns at once), the producer (what it did not
        transmit is gone with the process that follows), then the store's sessions (the fence goes with them)."""
        host = self._host
        if self.election_thread is not None:
            self.election_thread.stop()
        self.producer.purge()
        self.producer.close()
        host.store.close()
        host.closed()

    def wake(self) -> None:
        self._host.wake()

    def wait(self, deadline: float) -> None:
        raise AssertionError("the world runs the engine's steps (EngineHost); nothing waits")

    # -- EngineIO -------------------------------------------------------------------------------

    @property
    def producer(self) -> MemoryProducer:
        return self.producers.current

    @property
    def batch_limit(self) -> int:
        return self.producers.batch_limit

    def _new_producer(self, batch_limit: int | None) -> MemoryProducer:
        producer = self._host.new_producer()
        if batch_limit is not None and batch_limit < UNLIMITED:
            producer.batch_bytes = batch_size_for(batch_limit)
        return producer

    def topic_limit_stale(self, topic: str) -> bool:
        return False

    def topic_limit(self, topic: str) -> int | None:
        if topic not in self._limits:
            self._read_limit(topic)
        return self._limits.get(topic)

    def _read_limit(self, topic: str) -> None:
        """An admin request for the topic's configuration, answered a moment later."""
        host = self._host
        if topic in self._reading:
            return
        self._reading.add(topic)

        def answered() -> None:
            self._reading.discard(topic)
            if host.crashed:
                return
            self._limits[topic] = host.kafka.max_message_bytes.get(topic, UNLIMITED)
            host.world.after(host.limits.topic_limits_interval, lambda: self._read_limit(topic))
        host.world.after(host.world.latency(0.001, 0.02), answered)

    def fit_batches(self, limit: int) -> bool:
        return self.producers.fit(limit)

    def refused_for_size(self, topic: str | None) -> None:
        for name in [topic] if topic is not None else list(self._limits):
            self._read_limit(name)

    def submit(self, session: str, job: Callable[[Store], None]) -> None:
        host = self._host
        host.on_session(session, lambda: job(host.store))

    def restart_producer(self) -> None:
        self.producers.restart()
        self._host.world.after(0.001, self._serve_retiring)

    def _serve_retiring(self) -> None:
        """The delivery thread's turn for the producers replaced (RecordProducers.serve_retiring), every 5 ms
        while one has reports to deliver (the memory broker delivers them on the world's clock: poll() is empty)."""
        if self._host.crashed:
            return
        producers = self.producers
        producers.serve_retiring(lambda producer, timeout: producer.poll(timeout))
        if producers.retiring:
            self._host.world.after(0.005, self._serve_retiring)

    def _retired(self) -> None:
        assert self.driver is not None
        self.driver.post(methodcaller("on_producer_restarted"))

    def publish_dead_letter(self, record: Record, reason: str) -> str | None:
        return None

    def release_partition(self) -> None:
        assert self.election_thread is not None
        self.election_thread.released()

    def leadership(self, *, assigned: bool, leading: bool) -> None:
        assert self.election_thread is not None
        self.election_thread.poll.heartbeat = assigned

    def announce(self, event: events.Event) -> None:
        host = self._host
        host.log.events.append((host.world.now, host.name, type(event).__name__))
        if isinstance(event, events.LeaderAcquired | events.LeaderRefreshed):
            host.log.leader_ids.append((host.name, event.leader_id))
        host.world.note(f"{host.name} {event}")
        self._announce(event)


class NoStatusRow:
    """The connector a simulated engine is given: what it does with Postgres and Kafka is the world's (SimIO);
    its status row is its process's to write (status_table.py)."""

    def status_reporter(self, *_: Any, **__: Any) -> None:
        return None


class SimHarvester(Harvester):
    """The production Harvester, built over the world: the scenario's core and driver (a mutation plants its bug in
    them), the world's I/O (SimIO). Its open(), step(), stop(), wait() and end are the production code's."""

    def __init__(self, host: EngineHost, config: HarvestConfig, *, core_factory: Callable[..., Core],
                 driver_factory: Callable[..., Driver]) -> None:
        self.host = host
        #: The world's name for this engine (traces and violations name it).
        self.name = host.name
        self._core_factory, self._driver_factory = core_factory, driver_factory
        super().__init__(config, connector=NoStatusRow(), clock=lambda: host.world.now)  # type: ignore[arg-type]

    @property
    def core(self) -> Core:
        return self._core

    @property
    def io(self) -> SimIO:
        return self._io  # type: ignore[return-value]  # what _new_io built

    def start(self) -> None:
        """Harvester.start: open(), then its threads, which are world events here."""
        self.open()
        self._io.start()

    def _new_core(self) -> Core:
        config, world = self.config, self.host.world
        sharded = ({"handoff_by_fence": True, "leads": f"shard {config.shard} of {config.shards}"}
                   if config.shards > 1 else {})
        core = self._core_factory(config.limits, new_leader_id=world.uuid, park_after=config.park_after,
                                  now=world.now, **sharded)
        core.checking = True
        return core

    def _new_io(self) -> SimIO:  # type: ignore[override]
        return SimIO(self.host, self._announce)

    def _new_driver(self, tracer: Any) -> Driver:
        return self._driver_factory(self._core, self._io)


class EngineHost:
    """One engine's threads and clients in the world, running a SimHarvester."""

    def __init__(self, process: Process, name: str, config: HarvestConfig, store: MemoryStore, election: Election, *,
                 core_factory: Callable[..., Core] = Core, driver_factory: Callable[..., Driver] = Driver,
                 election_poll_class: type[ElectionPoll] = ElectionPoll,
                 on_closed: Callable[[EngineHost], None] = lambda host: None) -> None:
        self.process = process
        self.world = process.world
        self.name = name
        self.limits = config.limits
        self.kafka = process.kafka
        self.table = process.table
        self.log = process.log
        self.store = store
        self.election = election
        self.election_poll_class = election_poll_class
        self._on_closed = on_closed
        #: A thread of the I/O died: the Harvester's next step ends the engine.
        self.failure: EngineFailed | None = None
        self.ended = False
        self._busy_until = {"fence": 0.0, "purge": 0.0}
        self._wake_at: float | None = None
        self._last_turn = -1.0
        self._spins = 0
        self.harvester = SimHarvester(self, config, core_factory=core_factory, driver_factory=driver_factory)

    # -- what SimIO and the election thread read ------------------------------------------------------

    @property
    def crashed(self) -> bool:
        """Its process was killed, or it ended: no thread of it runs any more, a statement already sent included (the
        election thread, the delivery thread and the admin requests read this too)."""
        return self.process.crashed or self.ended

    @property
    def paused_until(self) -> float:
        return self.process.paused_until

    def process_running(self) -> bool:
        return self.process.process_running()

    def new_producer(self) -> MemoryProducer:
        pipelined = self.limits.max_in_flight_per_key > 1
        process = self.process
        return MemoryProducer(self.kafka, self.name, gapless=pipelined,
                              delivery_timeout=None if pipelined else self.limits.delivery_timeout,
                              is_running=process.process_running, can_reach=lambda: process.links.records)

    def on_session(self, name: str, job: Callable[[], None]) -> None:
        """Each session runs one statement at a time, with a latency (now and then a long one)."""
        faults = self.table.faults
        start = max(self.world.now, self._busy_until[name])
        slow = self.world.now < self.process.slow_until or self.world.chance(faults.slow)
        finish = start + self.world.latency(*(faults.slow_latency if slow else faults.latency))
        self._busy_until[name] = finish

        def execute() -> None:
            if not self.crashed:
                job()
        self.world.at(finish, execute)

    # -- what happens to it -------------------------------------------------------------------------

    def fail(self, why: str) -> None:
        """A thread of its I/O dies: the Harvester ends the engine at its next step (which is due at once)."""
        if self.crashed or self.failure is not None:
            return
        self.world.note(f"{self.name} failed: {why}")
        self.failure = EngineFailed(why)
        self.wake()

    def crash(self) -> None:
        """Its process is killed: its sessions end, and what its producer had not transmitted is gone."""
        self.store.close()
        self.harvester.io.producer.purge()
        self.harvester.io.producer.close()

    def closed(self) -> None:
        """The Harvester closed its I/O (SimIO.close): the engine thread ends."""
        self.ended = True
        self.world.note(f"{self.name} stopped")
        self._on_closed(self)

    # -- the engine thread ----------------------------------------------------------------------------

    def wake(self, delay: float = 0.0) -> None:
        if self.crashed:
            return
        when = self.world.now + max(0.0, delay)
        if self._wake_at is not None and self._wake_at <= when:
            return
        self._wake_at = when
        self.world.at(when, lambda: self._turn(when))

    def paused(self) -> None:
        """SIGSTOP: the turn it waits for is put off (wake() it at SIGCONT)."""
        self._wake_at = None

    def resumed(self) -> None:
        """SIGCONT: the engine thread runs at once."""
        self._wake_at = None
        self.wake()

    def _turn(self, scheduled: float) -> None:
        if self._wake_at != scheduled:
            return  # superseded by an earlier wake
        self._wake_at = None
        if self.crashed or not self.process.process_running():
            return
        if scheduled == self._last_turn:
            self._spins += 1
            if self._spins > 10_000:
                core = self.harvester.core
                raise Violation(f"{self.name}: the core keeps asking to run again at once (phase "
                                f"{core.phase.value}, deadline {core.next_deadline()})")
        else:
            self._last_turn, self._spins = scheduled, 0
        RUNNING[0] = self.name
        deadline = self.harvester.step()
        RUNNING[0] = ""
        if deadline is not None:
            self.wake(deadline - self.world.now)
            return
        try:
            self.harvester.wait(0)
        except HarvestError as ended:
            if isinstance(ended.__cause__, AssertionError):
                # The core's own invariant checks (Core.checking), or a model's Violation raised inside the step. The
                # Harvester ends its engine on any failure, as it must in production; here that is a broken invariant.
                raise Violation(f"{self.name}: {ended.__cause__}") from ended.__cause__
