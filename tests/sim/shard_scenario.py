"""A whole simulated run of a sharded group (`harvest --shards N`) from one seed, then the checks.

    python -m tests.sim.shard_scenario 1234          # run one seed, print what happened
    python -m tests.sim.shard_scenario 1234 --trace  # and the trace of every fault, rebalance and term

The seed picks the number of shards (2, 3, 4 or 6), 2 to 4 replicas (shard_replica.py), one or several
records per key in flight, the keys and their causal writers (late commits and rollbacks: gaps in each
shard), poison records now and then, and a schedule of faults: crashes, pauses (some past the session
timeout: zombies), graceful restarts, rolling restarts of every replica one by one, joins of new
replicas, links to Kafka or Postgres cut, database sessions dropped, statements that fail, batches
refused or their acknowledgement lost, and (drawn apart) engine threads that fail. Faults stop at a fixed
time; the run then goes on until every record is published (or a deadline passes).

Checked as the run goes: nobody marks a shard without holding its fence (memory/table.py), and no
engine publishes a record of a shard for the first time after another engine marked that shard (the
hand-off: a shard moves only once its old leader settled or fenced itself). The process's own duties: an
engine whose shard was taken away stops, no two engines of one shard run in one process, a failed engine
waits out its backoff, and the health probe's verdict on the status rows (status_table.py) credits each
replica with its own shards. At the end, as for the unsharded runs (checks.py): per-key order, nothing
lost, everything published, leader ids never reused.
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from unittest import mock

from outbox.harvest.core import Core
from outbox.harvest.driver import Driver
from outbox.harvest.harvester import State
from outbox.harvest.memory_table import MemoryTable, TableFaults, key_shard
from outbox.harvest.supervisor import Supervisor
from outbox.kafka.memory.broker import HUGE, POISON, MemoryBroker, ProducerFaults, StoredMessage
from outbox.kafka.memory.world import SimWorld, Violation
from tests.sim import checks, replay
from tests.sim.engine import RUNNING
from tests.sim.replica import Log
from tests.sim.scenario import Result, finished_when_drained, limits_for, operate_on_poison
from tests.sim.shard_replica import ShardedReplica
from tests.sim.status_table import REPORT_EVERY, StatusTable

#: Seeds that broke an invariant through what the simulator found in the shard code, now fixed
#: (docs/simulation.md, "Shards"); they run with every test of the sharded runs, and must pass.
REGRESSIONS: dict[int, str] = {
    103: "a leader's fence session dropped with records in flight; the shard moved and its records landed late "
         "(fixed: the shard terms row says the leader did not settle, and its successor waits)",
    706: "a zombie saw a heartbeat from before its pause and took the fence a dropped session had freed "
         "(fixed: a heartbeat older than heartbeat_timeout counts for nothing)",
    1000: "a leader's fence session dropped with records in flight; the next leader marked before they landed "
          "(fixed as 103)",
}

FAULTS_END = 25.0
DEADLINE = FAULTS_END + 60.0
SHARD_COUNTS = (2, 3, 4, 6)
#: A replica's manager stops the engine of a shard it let go within this much running time (it looks every
#: shards.MANAGE_INTERVAL); the watch looks every CHECK_EVERY.
RETIRE_WITHIN = 1.0
CHECK_EVERY = 0.25


@dataclass
class ShardOptions:
    """What a mutation (tests/sim/mutations.py) may change about a sharded run."""

    core_factory: Callable[..., Core] = Core
    driver_factory: Callable[..., Driver] = Driver
    table_factory: Callable[..., MemoryTable] = MemoryTable
    per_key: int | None = None
    #: The reconcile step of each replica's engines (supervisor.Supervisor).
    supervisor_class: type[Supervisor[int, Any]] = Supervisor
    #: Production functions replaced for the run, by dotted name (unittest.mock.patch).
    patches: dict[str, Any] = field(default_factory=dict)


class TraceLog(logging.Handler):
    """With --trace, the engines' log lines go into the trace, named by the engine whose turn logged them."""

    def __init__(self, world: SimWorld) -> None:
        super().__init__(logging.INFO)
        self.world = world

    def emit(self, record: logging.LogRecord) -> None:
        self.world.note(f"{RUNNING[0] or '-'}: {record.getMessage()}")


class HandOffLedger:
    """Watches the records topic: a record of a shard published for the first time by an engine other than
    the one that marked the shard last is a hand-off that did not wait (the old leader's record landed
    after its successor began). Repeats of records already published are allowed, as in the order check."""

    def __init__(self, table: MemoryTable, shards: int) -> None:
        self.table = table
        self.shards = shards
        self.seen: set[int] = set()

    def visible(self, messages: list[StoredMessage]) -> None:
        for message in messages:
            record_id = message.record_id
            if message.topic() != checks.TOPIC or record_id is None:
                continue
            shard = key_shard(message.key_text, self.shards)
            leader = self.table.marked_by.get((self.shards, shard))
            if record_id not in self.seen and leader is not None and leader != message.replica:
                raise Violation(f"{message.replica} published record {record_id} (key {message.key_text}, shard "
                                f"{shard}) after {leader} had begun marking that shard")
            self.seen.add(record_id)

    def committed(self, group: str, offsets: object) -> None:
        pass


def run(seed: int, options: ShardOptions | None = None, *, trace: bool = False) -> Result:
    options = options or ShardOptions()
    world = SimWorld(seed)
    world.keep_trace = trace
    handler = TraceLog(world) if trace else None
    if handler is not None:
        logger = logging.getLogger("outbox")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    try:
        with ExitStack() as patched:
            for target, replacement in options.patches.items():
                patched.enter_context(mock.patch(target, replacement))
            return _run(seed, options, world)
    finally:
        if handler is not None:
            logger.removeHandler(handler)
            logger.propagate = True
            replay.quiet()


def _run(seed: int, options: ShardOptions, world: SimWorld) -> Result:
    rng = world.rng
    shards = rng.choice(SHARD_COUNTS)
    kafka = MemoryBroker(world, partitions=rng.randint(1, 4), faults=ProducerFaults())
    table = options.table_factory(world, published=kafka.published.__contains__, faults=TableFaults())
    kafka.watchers.append(HandOffLedger(table, shards))
    log = Log()
    per_key = options.per_key or rng.choice((1, 4))
    limits = limits_for(world, per_key)
    park_after = 2 if world.chance(0.15) else None
    replicas: list[ShardedReplica] = []
    counter = iter(range(1_000_000))
    status_table = StatusTable(world)

    def spawn(delay: float = 0.0) -> ShardedReplica:
        replica = ShardedReplica(world, f"r{next(counter)}", "g1", shards, limits, kafka, table, log,
                                 park_after=park_after, core_factory=options.core_factory,
                                 driver_factory=options.driver_factory,
                                 supervisor_class=options.supervisor_class, status_table=status_table)
        replicas.append(replica)
        world.after(delay, replica.start)
        return replica

    for _ in range(rng.randint(2, 4)):
        spawn(rng.uniform(0, 1.0))

    # -- writers: each key's records are causal (the next is written after the last committed) ----
    keys = [f"k{i}" for i in range(rng.randint(2, 16))]
    total = rng.randint(80, 400)
    poison_count = rng.choice((0, 0, 0, 0, 1, 2))
    write_window = rng.uniform(4.0, 22.0)  # the faults come while records are written
    per_key_rate = total / (len(keys) * write_window)
    written = {"n": 0}
    rollbacks = rng.choice((0.0, 0.0, 0.02, 0.1))
    poison_ids: list[int] = []

    def write(key: str) -> None:
        if written["n"] >= total:
            return
        written["n"] += 1
        value = "v"
        if poison_count and len(poison_ids) < poison_count and world.chance(0.02):
            value = rng.choice((POISON, HUGE))
        row = table.insert(key, value)
        commit_in = rng.uniform(0.0001, 0.02) if not world.chance(0.03) else rng.uniform(0.2, 2.0)
        if world.chance(rollbacks):
            written["n"] -= 1
            world.after(commit_in, lambda: (table.rollback(row), write(key)))
            return
        if value != "v":
            poison_ids.append(row.id)

        def commit() -> None:
            table.commit(row)
            world.after(rng.expovariate(per_key_rate), lambda: write(key))
        world.after(commit_in, commit)

    for key in keys:
        world.after(rng.uniform(0, 0.5), lambda key=key: write(key))

    # -- faults -----------------------------------------------------------------------------------
    table.faults = TableFaults(fail_before=rng.choice((0, 0.005, 0.02)), fail_after=rng.choice((0, 0.005, 0.02)),
                               slow=rng.choice((0, 0, 0.02, 0.1)))
    kafka.faults = ProducerFaults(transient=rng.choice((0, 0.01, 0.05)), ack_lost=rng.choice((0, 0.01, 0.05)),
                                  fatal=rng.choice((0, 0, 0.002)))

    def live() -> list[ShardedReplica]:
        return [r for r in replicas if r.live]

    def restart(replica: ShardedReplica, then: Callable[[], None] | None = None) -> None:
        """Stop gracefully; once it has stopped, start a new incarnation (and then `then`)."""
        replica.stop()

        def watch() -> None:
            if replica.finished or replica.crashed:
                world.after(rng.uniform(0.1, 2.0), lambda: (spawn(), then() if then else None))
            else:
                world.after(0.1, watch)
        world.after(0.1, watch)

    def rolling(order: list[ShardedReplica]) -> None:
        if order:
            restart(order[0], lambda: world.after(rng.uniform(0.5, 3.0), lambda: rolling(order[1:])))

    def fault() -> None:
        candidates = live()
        if not candidates:
            return
        replica = rng.choice(candidates)
        kind = rng.choice(("crash", "pause", "pause_long", "stop", "rolling", "join", "join_slow", "join_slow",
                           "slow_kafka", "leader_link", "records_link", "database_link", "drop_sessions",
                           "slow_database", "long_transaction"))
        world.note(f"fault: {kind} on {replica.name}")
        if kind in ("join", "join_slow"):
            # Scaled out: shards move to the newcomer, now and then while the records of their old leader
            # are slow to land (its link to the record brokers blinks): the hand-off waits for them.
            spawn()
            if kind == "join_slow":
                replica.links.records = False
                world.after(rng.uniform(0.3, 3.0), lambda: setattr(replica.links, "records", True))
        elif kind == "slow_kafka":
            # The brokers answer slowly for a while: every engine has records in flight for longer.
            kafka.faults.latency = (0.05, 0.6)
            world.after(rng.uniform(1.0, 6.0), lambda: setattr(kafka.faults, "latency", ProducerFaults().latency))
        elif kind == "rolling":
            rolling(candidates)
        elif kind == "stop":
            restart(replica)
        elif kind == "crash":
            replica.crash()
            spawn(rng.uniform(0.2, 4.0))
        elif kind == "pause":
            replica.pause(rng.uniform(0.2, 2.5))
        elif kind == "pause_long":
            replica.pause(rng.uniform(3.0, 8.0))  # past the session timeout: a zombie on resume
        elif kind == "slow_database":
            replica.slow_until = world.now + rng.uniform(1.0, 6.0)
        elif kind == "long_transaction":
            xid = table.begin("a long transaction")
            world.after(rng.uniform(1.0, 12.0), lambda: table.end(xid))
        elif kind == "drop_sessions":
            for engine in list(replica.engines.values()):
                if world.chance(0.5):
                    table.drop(engine.host.store.fence)
                    table.drop(engine.host.store.purger)
        else:
            link = kind.split("_")[0]
            setattr(replica.links, link, False)
            world.after(rng.uniform(0.3, 5.0), lambda: setattr(replica.links, link, True))

    for _ in range(rng.randint(0, 12)):
        world.at(rng.uniform(0.5, FAULTS_END - 1), fault)

    def calm() -> None:
        table.faults = TableFaults()
        kafka.faults = ProducerFaults()
        for replica in replicas:
            replica.links.leader = replica.links.records = replica.links.database = True
        if not live():
            spawn()

    # An engine's thread fails now and then (a bug, a surprise from a client): the process starts the shard's
    # engine again after a backoff. Drawn from a stream of its own, so the other faults draw as before.
    failures = random.Random(seed * 1_000_003 + 17)

    def engine_fails() -> None:
        engines = sorted((engine for replica in live() for engine in replica.engines.values()
                          if engine.state is State.RUNNING), key=lambda engine: engine.name)
        if engines:
            failures.choice(engines).host.fail("a simulated failure of its thread")

    if failures.random() < 0.5:
        for _ in range(failures.randint(1, 4)):
            world.at(failures.uniform(0.5, FAULTS_END - 1), engine_fails)

    # The coordinator now and then revokes a shard from its replica and assigns it straight back (a cooperative
    # rebalance whose intended taker left first): the engine whose term the revoke ended must give way to a fresh
    # one. Drawn from a stream of its own, so the other faults draw as before.
    bounces = random.Random(seed * 1_000_037 + 31)

    def bounce() -> None:
        group = kafka.consumer_groups.get("g1")
        owned = sorted(group.owners) if group is not None else []
        if owned:
            tp = bounces.choice(owned)
            world.note(f"fault: shard {tp[1]} revoked from {group.owners[tp].name} and assigned back")
            group.bounce(tp)

    if bounces.random() < 0.3:
        for _ in range(bounces.randint(1, 3)):
            world.at(bounces.uniform(0.5, FAULTS_END - 1), bounce)

    world.at(FAULTS_END, calm)

    operator = operate_on_poison(world, rng, table, poison_ids, poison_count, FAULTS_END)

    # -- the process's own duty: an engine whose shard was taken away stops ---------------------------
    gone_since: dict[object, float] = {}

    def watch_engines() -> None:
        """A replica stops the engine of a shard it let go (its revoke or loss taken in) within RETIRE_WITHIN of
        running time; a paused replica's clock does not count."""
        for replica in replicas:
            if replica.restarted_early:
                raise Violation(replica.restarted_early[0])
            if replica.finished and not replica.crashed and replica.engines_not_stopped():
                raise Violation(f"{replica.name} stopped (its consumer left the group) while "
                                f"{', '.join(engine.name for engine in replica.engines_not_stopped())} had not")
            running = replica.live and replica.process_running()
            for engine in replica.engines.values():
                if not running or engine.state is not State.RUNNING or not engine.host.election.gone:
                    gone_since.pop(engine, None)
                    continue
                since = gone_since.setdefault(engine, world.now)
                if world.now - since > RETIRE_WITHIN:
                    raise Violation(f"{engine.name} still runs {world.now - since:.2f}s after it let shard "
                                    f"{engine.config.shard} go (owned now: {sorted(replica.group.owned())})")
        world.after(CHECK_EVERY, watch_engines)

    world.after(CHECK_EVERY, watch_engines)

    def watch_status() -> None:
        status_table.check_verdict()
        world.after(REPORT_EVERY, watch_status)

    world.after(REPORT_EVERY + CHECK_EVERY, watch_status)  # between the processes' writes

    # -- run ----------------------------------------------------------------------------------------
    done = finished_when_drained(world, table, written, total, FAULTS_END)

    def summary() -> str:
        return (f"seed {seed}: {shards} shards, {per_key} per key, {len(keys)} key(s), {total} records, "
                f"{kafka.partitions} partition(s), {len(poison_ids)} poison ({operator}), park_after={park_after}")
    try:
        world.run_until(DEADLINE, done=done)
        if written["n"] < total:
            raise Violation(f"the writers did not finish ({written['n']} of {total})")
        checks.check_order(kafka, strict=per_key == 1)
        checks.check_leader_ids(log)
        checks.check_nothing_lost(kafka, table)
        checks.check_drained(table)
    except AssertionError as violation:
        return Result(seed, False, f"t={world.now:.3f}: {violation}", summary(), world.trace)
    published = len(kafka.messages(checks.TOPIC))
    leaders = len({name.split("-s")[0] for name, _ in log.leader_ids})
    text = (f"{summary()}; {len(replicas)} replica incarnation(s), {leaders} of them led, {published} messages, "
            f"done at t={world.now:.1f}")
    return Result(seed, True, None, text, world.trace)


#: run(), for a pool of processes: (seed, violation or None, summary).
run_quietly = partial(replay.quietly, run)


def main(argv: list[str]) -> int:
    return replay.main(argv, run, __doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
