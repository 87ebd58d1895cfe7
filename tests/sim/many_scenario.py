"""A whole simulated run of processes that harvest many outboxes (`harvest --outbox`, `--tenant-schemas`), from one
seed, then the checks.

    python -m tests.sim.many_scenario 1234          # run one seed, print what happened
    python -m tests.sim.many_scenario 1234 --trace  # and the trace of every fault, discovery and term

The seed picks 1 to 3 processes (many_process.py: the production ManyHarvester each), 2 to 4 outboxes to begin
with (each its own table, Kafka cluster, leader group; one record or four per key in flight), their keys and
causal writers, and a schedule of faults: processes killed (a new one later) or paused (some past the session
timeout), one outbox's engine thread failing while the others go on, an outbox created while running (a tenant
schema: discovery finds it), one dropped (its engines stop), discovery failing for a while (the outboxes found
before go on). Faults stop at a fixed time; the run then goes on until every record of every outbox still there
is published (or a deadline passes).

Checked as the run goes: an engine of an outbox discovery no longer finds is asked to stop within RETIRE_WITHIN
of its process's running time after the next rescan, and no other is (a failed discovery stops nothing); an
engine of an outbox starts in a process only once the last one stopped and not within the restart backoff after
it failed. At the end, for each outbox still there, as for one table (checks.py): per-key order, nothing lost,
everything published; for a dropped one, per-key order of what it published; leader ids never reused anywhere.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from outbox.harvest.config import HarvestConfig
from outbox.harvest.core import Core
from outbox.harvest.harvester import State
from outbox.harvest.memory_table import MemoryTable, TableFaults
from outbox.harvest.outboxes import ManyHarvester
from outbox.harvest.supervisor import RESTART_BACKOFF, Supervisor
from outbox.kafka.memory.broker import MemoryBroker, ProducerFaults
from outbox.kafka.memory.world import SimWorld, Violation
from tests.sim import checks, replay
from tests.sim.many_process import RESCAN_EVERY, ManyProcess, Outbox, OutboxEngine
from tests.sim.replica import Log
from tests.sim.scenario import Result, limits_for

FAULTS_END = 25.0
DEADLINE = FAULTS_END + 60.0
#: An engine whose outbox discovery no longer finds is asked to stop within this much of its process's running
#: time after the rescan that could first have seen it gone; the watch looks every CHECK_EVERY.
RETIRE_WITHIN = RESCAN_EVERY + 0.5
CHECK_EVERY = 0.25


@dataclass
class ManyOptions:
    """What a mutation (tests/sim/mutations.py) may change about a run of many outboxes."""

    core_factory: Callable[..., Core] = Core
    harvester_class: type[ManyHarvester] = ManyHarvester
    #: The reconcile step of each process's engines (supervisor.Supervisor).
    supervisor_class: type[Supervisor[str, Any]] = Supervisor


@dataclass
class Writing:
    """One outbox's writers: how many records it gets in all, and how many are written."""

    total: int
    written: int = 0
    keys: list[str] = field(default_factory=list)


class Discovery:
    """What the processes' discover() finds: the outboxes there now (a dropped one is not), or a failure."""

    def __init__(self) -> None:
        self.found: dict[str, HarvestConfig] = {}
        self.failing = False

    def __call__(self) -> dict[str, HarvestConfig]:
        if self.failing:
            raise ConnectionError("the catalog query failed (simulated)")
        return dict(self.found)


class Watch:
    """The processes' duties as the run goes (module docstring)."""

    def __init__(self, world: SimWorld, discovery: Discovery) -> None:
        self.world, self.discovery = world, discovery
        self.gone_since: dict[OutboxEngine, float] = {}
        self.failed_at: dict[tuple[str, str], float] = {}
        self.early: list[str] = []

    def started(self, process: ManyProcess, label: str) -> None:
        """A process starts an engine of `label`: not beside one that has not stopped, nor within its backoff."""
        others = [engine.name for engine in process.started if engine.label == label
                  and engine.state is not State.STOPPED and not engine.replica.crashed]
        if others:
            self.early.append(f"{process.name} started an engine of outbox {label} while {', '.join(others)} "
                              f"had not stopped")
        failed_at = self.failed_at.pop((process.name, label), None)
        if failed_at is not None and self.world.now - failed_at < RESTART_BACKOFF:
            self.early.append(f"{process.name} started outbox {label}'s engine again "
                              f"{self.world.now - failed_at:.2f}s after it failed, within the restart backoff")

    def failed(self, process: ManyProcess, label: str) -> None:
        self.failed_at[(process.name, label)] = self.world.now

    def look(self, processes: list[ManyProcess]) -> None:
        if self.early:
            raise Violation(self.early[0])
        found = self.discovery.found
        for label in [label for (_, label) in self.failed_at if label not in found]:
            for key in [key for key in self.failed_at if key[1] == label]:
                del self.failed_at[key]  # the outbox went: its next engine is a new start, not a restart
        for process in processes:
            for engine in process.started:
                if engine.state is State.STOPPING and engine.label in found and not process.crashed:
                    raise Violation(f"{engine.name} was asked to stop while outbox {engine.label} is there")
            running = process.process_running() and not self.discovery.failing
            for engine in process.started:
                if not running or engine.state is not State.RUNNING or engine.label in found:
                    self.gone_since.pop(engine, None)
                    continue
                since = self.gone_since.setdefault(engine, self.world.now)
                if self.world.now - since > RETIRE_WITHIN:
                    raise Violation(f"{engine.name} still runs {self.world.now - since:.2f}s after outbox "
                                    f"{engine.label} was dropped")


def run(seed: int, options: ManyOptions | None = None, *, trace: bool = False) -> Result:
    options = options or ManyOptions()
    world = SimWorld(seed)
    world.keep_trace = trace
    try:
        return _run(seed, options, world)
    finally:
        replay.quiet()


def _run(seed: int, options: ManyOptions, world: SimWorld) -> Result:
    rng = world.rng
    log = Log()
    per_key = rng.choice((1, 4))
    limits = limits_for(world, per_key)
    outboxes: dict[str, Outbox] = {}
    writing: dict[str, Writing] = {}
    discovery = Discovery()
    dropped: set[str] = set()
    watch = Watch(world, discovery)
    labels = iter(f"t{i}" for i in range(1_000_000))

    # -- outboxes and their writers: each key's records are causal ----------------------------------
    def write(label: str, key: str, rate: float) -> None:
        progress = writing[label]
        if progress.written >= progress.total or label in dropped:
            return
        progress.written += 1
        table = outboxes[label].table
        row = table.insert(key, "v")
        commit_in = rng.uniform(0.0001, 0.02) if not world.chance(0.03) else rng.uniform(0.2, 2.0)

        def commit() -> None:
            table.commit(row)
            world.after(rng.expovariate(rate), lambda: write(label, key, rate))
        world.after(commit_in, commit)

    def create_outbox() -> str:
        label = next(labels)
        kafka = MemoryBroker(world, partitions=rng.randint(1, 3), faults=ProducerFaults())
        table = MemoryTable(world, published=kafka.published.__contains__, faults=TableFaults())
        config = HarvestConfig(dsn="sim", table=f"{label}.outbox", leader_topic=f"leader-{label}",
                               leader_group=f"g-{label}", name=label, limits=limits)
        outboxes[label] = Outbox(label, table, kafka, config)
        progress = writing[label] = Writing(total=rng.randint(20, 120),
                                            keys=[f"{label}k{i}" for i in range(rng.randint(1, 6))])
        rate = progress.total / (len(progress.keys) * rng.uniform(0.5, 15.0))
        for key in progress.keys:
            world.after(rng.uniform(0, 0.5), lambda key=key: write(label, key, rate))
        discovery.found[label] = config
        world.note(f"outbox {label} created")
        return label

    for _ in range(rng.randint(2, 4)):
        create_outbox()

    # -- processes ----------------------------------------------------------------------------------
    processes: list[ManyProcess] = []
    counter = iter(range(1_000_000))

    def spawn(delay: float = 0.0) -> ManyProcess:
        process = ManyProcess(world, f"p{next(counter)}", discovery, outboxes.__getitem__, limits, log,
                              core_factory=options.core_factory, harvester_class=options.harvester_class,
                              supervisor_class=options.supervisor_class, on_engine=watch.started)
        processes.append(process)

        def start() -> None:
            if not process.start():  # its first discovery failed: the process manager starts it again
                spawn(rng.uniform(1.0, 3.0))
        world.after(delay, start)
        return process

    for _ in range(rng.randint(1, 3)):
        spawn(rng.uniform(0, 1.0))

    def live() -> list[ManyProcess]:
        return [process for process in processes if not process.crashed]

    # -- faults -------------------------------------------------------------------------------------
    def fault() -> None:
        candidates = live()
        if not candidates:
            return
        process = rng.choice(candidates)
        kind = rng.choice(("crash", "pause", "pause_long", "engine_fails", "engine_fails", "outbox_created",
                           "outbox_dropped", "discovery_fails"))
        world.note(f"fault: {kind} on {process.name}")
        if kind == "crash":
            process.crash()
            spawn(rng.uniform(0.2, 4.0))
        elif kind == "pause":
            process.pause(rng.uniform(0.2, 2.5))
        elif kind == "pause_long":
            process.pause(rng.uniform(3.0, 8.0))  # past the session timeout: a zombie on resume
        elif kind == "engine_fails":
            engines = sorted((engine for engine in process.started if engine.state is State.RUNNING),
                             key=lambda engine: engine.name)
            if engines:
                engine = rng.choice(engines)
                engine.fail("a simulated failure of its thread")
                watch.failed(process, engine.label)
        elif kind == "outbox_created":
            create_outbox()
        elif kind == "outbox_dropped":
            there = sorted(discovery.found)
            if len(there) > 1:
                label = rng.choice(there)
                del discovery.found[label]
                dropped.add(label)
                world.note(f"outbox {label} dropped")
        else:
            discovery.failing = True
            world.after(rng.uniform(0.5, 5.0), lambda: setattr(discovery, "failing", False))

    for _ in range(rng.randint(0, 10)):
        world.at(rng.uniform(0.5, FAULTS_END - 1), fault)

    def calm() -> None:
        discovery.failing = False
        if not live():
            spawn()

    world.at(FAULTS_END, calm)

    def look() -> None:
        watch.look(processes)
        world.after(CHECK_EVERY, look)

    world.after(CHECK_EVERY, look)

    # -- run ----------------------------------------------------------------------------------------
    def there() -> list[str]:
        return sorted(label for label in outboxes if label not in dropped)

    done = {"flag": False}

    def finished() -> None:
        if world.now > FAULTS_END and all(writing[label].written >= writing[label].total
                                          and not outboxes[label].table.pending() for label in there()):
            done["flag"] = True
            return
        world.after(1.0, finished)

    world.at(FAULTS_END, finished)

    def summary() -> str:
        return (f"seed {seed}: {len(outboxes)} outbox(es) ({len(dropped)} dropped), {per_key} per key, "
                f"{sum(progress.total for progress in writing.values())} records")
    try:
        world.run_until(DEADLINE, done=lambda: done["flag"])
        for label in sorted(outboxes):
            outbox = outboxes[label]
            try:
                checks.check_order(outbox.kafka, strict=per_key == 1)
                if label not in dropped:
                    if writing[label].written < writing[label].total:
                        raise Violation(f"the writers did not finish ({writing[label].written} of "
                                        f"{writing[label].total})")
                    checks.check_nothing_lost(outbox.kafka, outbox.table)
                    checks.check_drained(outbox.table)
            except AssertionError as violation:
                raise Violation(f"outbox {label}: {violation}") from None
        checks.check_leader_ids(log)
    except AssertionError as violation:
        return Result(seed, False, f"t={world.now:.3f}: {violation}", summary(), world.trace)
    published = sum(len(outbox.kafka.messages(checks.TOPIC)) for outbox in outboxes.values())
    text = f"{summary()}; {len(processes)} process incarnation(s), {published} messages, done at t={world.now:.1f}"
    return Result(seed, True, None, text, world.trace)


#: run(), for a pool of processes: (seed, violation or None, summary).
run_quietly = partial(replay.quietly, run)


def main(argv: list[str]) -> int:
    return replay.main(argv, run, __doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
