"""A whole simulated run from one seed: replicas, writers, faults, then a quiet spell, then the checks.

    python -m tests.sim.scenario 1234          # run one seed, print what happened
    python -m tests.sim.scenario 1234 --trace  # and the trace of every fault and leadership change

The seed picks everything: how many replicas and leader groups, one or several records per key in
flight, the keys and records, poison records and what an operator does about them, and a schedule
of faults (crashes, pauses past the session timeout, network partitions between a replica and
Kafka or Postgres, database sessions dropped, statements failing before or after they commit,
batches refused or their acknowledgement lost, fatal producer errors). Faults stop at a fixed
time; the run then continues until everything is published (or a deadline passes).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from outbox.harvest.config import Limits
from outbox.harvest.core import Core
from outbox.harvest.driver import Driver
from outbox.harvest.memory_table import ASYNC_FLUSH_BOUND, MemoryTable, TableFaults
from outbox.harvest.neli import ElectionPoll
from outbox.kafka.memory.broker import HUGE, POISON, MemoryBroker, ProducerFaults
from outbox.kafka.memory.world import SimWorld, Violation
from outbox.kafka.sizes import record_size
from tests.sim import checks, replay
from tests.sim.replica import Log, SimReplica

FAULTS_END = 25.0
DEADLINE = FAULTS_END + 60.0


@dataclass
class Result:
    seed: int
    ok: bool
    violation: str | None
    summary: str
    trace: list[str] = field(default_factory=list)


@dataclass
class Options:
    """What a mutation (tests/sim/mutations.py) may change about a run."""

    core_factory: Callable[..., Core] = Core
    driver_factory: Callable[..., Driver] = Driver
    #: The election thread's step (neli.ElectionPoll).
    election_poll_class: type[ElectionPoll] = ElectionPoll
    #: Force one record per key in flight (the mutations are about goharvest's barrier).
    per_key: int | None = None
    #: Whether the database fence works (None: the seed decides; off models PgBouncer in transaction mode).
    db_fence: bool | None = None
    #: Whether the records' topic has a small max.message.bytes (None: the seed decides).
    topic_limits: bool | None = None
    #: Producers now and then number a partition's records from 0 again, which Kafka acknowledges as
    #: duplicates without writing them (ProducerFaults.seq_lost, outbox/harvest/acks.py). Off in the
    #: seeds' runs: with several records of a key in flight, a later one may be written before the
    #: earlier is sent again, an order no harvester can restore.
    lost_sequences: bool = False
    #: The database server crashes and restarts now and then, undoing the purges that committed
    #: asynchronously and were not flushed yet (MemoryTable.restart). Off in the seeds' runs, so their
    #: schedules stay as they were; tests/unit/test_simulation.py runs seeds with it.
    db_restarts: bool = False


def limits_for(world: SimWorld, per_key: int) -> Limits:
    throttle = world.rng.randint(2, 60)
    return Limits(
        io_error_backoff=0.05, min_poll_interval=0.1, heartbeat_timeout=1.0, queue_timeout=5.0,
        mark_backoff=0.02, idle_poll_interval=0.5, max_in_flight_records=throttle,
        purge_interval=(0.0, 0.005, 0.05)[throttle % 3],  # from a draw already made: the seeds stay as they were
        purge_delay=(0.0, 0.03, 0.3)[(throttle // 3) % 3],  # likewise
        max_in_flight_per_key=per_key, mark_query_records=world.rng.randint(3, 40),
        held_check_interval=0.5, held_retry_after=3.0, fence_retry_interval=1.0,
        min_metrics_interval=5.0, status_interval=0.0, topic_limits_interval=2.0,
    )


def run(seed: int, options: Options | None = None, *, trace: bool = False) -> Result:
    options = options or Options()
    world = SimWorld(seed)
    world.keep_trace = trace
    rng = world.rng
    kafka = MemoryBroker(world, partitions=rng.randint(1, 4), faults=ProducerFaults())
    table = MemoryTable(world, published=kafka.published.__contains__, faults=TableFaults())
    log = Log()
    per_key = options.per_key or rng.choice((1, 4))
    limits = limits_for(world, per_key)
    groups = ["g1", "g2"] if world.chance(0.1) else ["g1"]
    # Without the fence only Kafka's election keeps replicas apart: never with two groups.
    table.db_fence = options.db_fence if options.db_fence is not None else (len(groups) == 2 or not world.chance(0.1))
    park_after = 2 if world.chance(0.15) else None
    replicas: list[SimReplica] = []
    counter = iter(range(1_000_000))

    def spawn(group: str, delay: float = 0.0) -> SimReplica:
        replica = SimReplica(world, f"r{next(counter)}", group, limits, kafka, table, log, park_after=park_after,
                             core_factory=options.core_factory, driver_factory=options.driver_factory,
                             election_poll_class=options.election_poll_class)
        replicas.append(replica)
        world.after(delay, replica.start)
        return replica

    for index in range(rng.randint(1, 4)):
        spawn(groups[index % len(groups)], rng.uniform(0, 1.0))
    if len(groups) == 2 and len(replicas) == 1:
        spawn("g2", rng.uniform(0, 1.0))

    # -- a topic limit: batches must be built to fit it, and a record too big for it held -------------
    # Drawn from a generator of its own, so the seeds of runs without one keep their schedules.
    sizes = random.Random(seed * 7919 + 17)
    topic_limit = None
    limit_steady_from = 0.0  # from then on, no batch may be refused for its size
    if options.topic_limits if options.topic_limits is not None else sizes.random() < 0.25:
        typical = record_size("k10", "v", [("outbox-id", "100"), ("outbox-create-time", "2026-01-01T00:00:00Z")])
        topic_limit = typical * sizes.randint(2, 4)  # a few records a batch, where the producer would put 8
        kafka.max_message_bytes[checks.TOPIC] = topic_limit
        if sizes.random() < 0.5:
            # Lowered while the replicas run: they learn it from a refused batch or their next read.
            kafka.max_message_bytes[checks.TOPIC] = 10 * topic_limit
            lowered, lowered_at = {checks.TOPIC: topic_limit}, sizes.uniform(1.0, FAULTS_END)
            world.at(lowered_at, lambda: kafka.max_message_bytes.update(lowered))
            # Every replica reads it again within topic_limits_interval, at once after a refusal; one
            # paused or cut off from Kafka then may still have bigger batches on their way.
            limit_steady_from = FAULTS_END + 10.0 + 2 * limits.topic_limits_interval

    # -- writers: each key's records are causal (the next is written after the last committed) ----
    keys = [f"k{i}" for i in range(rng.randint(1, 12))]
    total = rng.randint(40, 250)
    poison_count = rng.choice((0, 0, 0, 0, 1, 2))
    write_window = rng.uniform(0.5, 18.0)
    per_key_rate = total / (len(keys) * write_window)  # records per second, each key
    written = {"n": 0}
    rollbacks = rng.choice((0.0, 0.0, 0.02, 0.1))
    poison_ids: list[int] = []

    def write(key: str) -> None:
        if written["n"] >= total:
            return
        written["n"] += 1
        value = "v"
        if poison_count and len(poison_ids) < poison_count and world.chance(0.02):
            value = rng.choice((POISON, HUGE))  # refused by the broker, or by the producer at produce()
            if topic_limit is not None and sizes.random() < 0.5:
                value = "B" * topic_limit  # fits the producer, not the topic: held before it is produced
        row = table.insert(key, value)
        # Commits land out of id order across keys; now and then one takes a long while, and now and
        # then a writer rolls back (its id is never seen: a gap that must be let go of).
        commit_in = rng.uniform(0.0001, 0.02) if not world.chance(0.03) else rng.uniform(0.2, 2.0)
        if world.chance(rollbacks):
            written["n"] -= 1  # written again
            world.after(commit_in, lambda: (table.rollback(row), write(key)))
            return
        if value != "v":  # POISON, HUGE, or too large for the topic's limit
            table.poison.add(row.id)
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
                                  fatal=rng.choice((0, 0, 0.002)), seq_lost=0.02 if options.lost_sequences else 0.0)

    def live() -> list[SimReplica]:
        return [r for r in replicas if r.running and not r.crashed and not r.stopped]

    def fault() -> None:
        candidates = live()
        if not candidates:
            return
        replica = rng.choice(candidates)
        kind = rng.choice(("crash", "pause", "pause_long", "leader_link", "records_link", "database_link",
                           "drop_sessions", "stop", "long_transaction", "slow_database", "join", "join_slow"))
        world.note(f"fault: {kind} on {replica.name}")
        if kind in ("join", "join_slow"):
            # Scaled out: the coordinator may move partition 0 to the newcomer, now and then while the
            # replica's records are slow to land (its link to their brokers blinks).
            spawn(replica.group_name)
            if kind == "join_slow":
                replica.links.records = False
                world.after(rng.uniform(0.3, 3.0), lambda: setattr(replica.links, "records", True))
        elif kind == "slow_database":
            replica.slow_until = world.now + rng.uniform(1.0, 6.0)
        elif kind == "long_transaction":
            # Somebody's long transaction (any table, any database) holds the oldest xmin back.
            xid = table.begin("a long transaction")
            world.after(rng.uniform(1.0, 12.0), lambda: table.end(xid))
        elif kind == "crash":
            replica.crash()
            spawn(replica.group_name, rng.uniform(0.2, 4.0))
        elif kind == "stop":
            replica.stop()
            spawn(replica.group_name, rng.uniform(0.2, 4.0))
        elif kind == "pause":
            replica.pause(rng.uniform(0.2, 2.5))
        elif kind == "pause_long":
            replica.pause(rng.uniform(3.0, 8.0))  # past the session timeout: a zombie on resume
        else:
            link = kind.split("_")[0]
            setattr(replica.links, link, False)
            world.after(rng.uniform(0.3, 5.0), lambda: setattr(replica.links, link, True))
            if kind == "drop_sessions":
                table.drop(replica.store.fence)
                table.drop(replica.store.purger)

    for _ in range(rng.randint(0, 12)):
        world.at(rng.uniform(0.5, FAULTS_END - 1), fault)

    # Drawn from a generator of its own, like the topic limit.
    restarts = random.Random(seed * 7919 + 29)

    def restart() -> None:
        sessions = [session for replica in replicas for session in (replica.store.fence, replica.store.purger)]
        undone = table.restart(sessions, lost_within=restarts.uniform(0.0, ASYNC_FLUSH_BOUND),
                               down_for=restarts.uniform(0.2, 3.0))
        world.note(f"fault: the database restarted; purges undone: {undone}")

    if options.db_restarts:
        for _ in range(restarts.randint(1, 4)):
            world.at(restarts.uniform(0.5, FAULTS_END - 1), restart)

    def calm() -> None:
        table.faults = TableFaults()
        kafka.faults = ProducerFaults()
        for replica in replicas:
            replica.links.leader = replica.links.records = replica.links.database = True
        for group in groups:
            if not any(r.group_name == group for r in live()):
                spawn(group)

    world.at(FAULTS_END, calm)

    # -- operators: what happens to poison ----------------------------------------------------------
    operator = operate_on_poison(world, rng, table, poison_ids, poison_count, FAULTS_END)

    # -- run ----------------------------------------------------------------------------------------
    done = finished_when_drained(world, table, written, total, FAULTS_END)
    def summary() -> str:
        limit = f", topic limit {topic_limit} bytes" if topic_limit else ""
        return (f"seed {seed}: {len(groups)} group(s){'' if table.db_fence else ' (no db fence)'}{limit}, "
                f"{per_key} per key, "
                f"{len(keys)} key(s), {total} records, "
                f"{kafka.partitions} partition(s), {len(poison_ids)} poison ({operator}), park_after={park_after}")
    try:
        world.run_until(DEADLINE, done=done)
        if written["n"] < total:
            raise Violation(f"the writers did not finish ({written['n']} of {total})")
        checks.check_order(kafka, strict=per_key == 1)
        checks.check_leader_ids(log)
        checks.check_nothing_lost(kafka, table)
        checks.check_drained(table)
        checks.check_batches_fit(kafka, limit_steady_from)
    except AssertionError as violation:  # a Violation, or an invariant the core asserts itself
        return Result(seed, False, f"t={world.now:.3f}: {violation}", summary(), world.trace)
    published = len(kafka.messages(checks.TOPIC))
    text = f"{summary()}; {len(replicas)} replica incarnation(s), {published} messages, done at t={world.now:.1f}"
    return Result(seed, True, None, text, world.trace)


#: run(), for a pool of processes: (seed, violation or None, summary).
run_quietly = partial(replay.quietly, run)


def main(argv: list[str]) -> int:
    return replay.main(argv, run, __doc__)



def operate_on_poison(world: SimWorld, rng: random.Random, table: MemoryTable, poison_ids: list[int], poison_count: int,
                      after: float) -> str:
    """An operator who, a while after the faults, fixes or deletes the poison rows (or does nothing)."""
    operator = rng.choice(("fix", "delete", "nothing"))

    def operate() -> None:
        for row_id in poison_ids:
            if row_id in table.rows:
                if operator == "fix":
                    table.operator_update(row_id, value="fixed")
                elif operator == "delete":
                    table.operator_delete(row_id)

    if poison_ids or poison_count:
        world.at(after + rng.uniform(0, 10), operate)
    return operator


def finished_when_drained(world: SimWorld, table: MemoryTable, written: dict[str, int], total: int,
                          after: float) -> Callable[[], bool]:
    """Whether the run is over: after the faults, every record written and none pending (looked at every second)."""
    done = {"flag": False}

    def watch() -> None:
        if world.now > after and written["n"] >= total and not table.pending():
            done["flag"] = True
            return
        world.after(1.0, watch)

    world.at(after, watch)
    return lambda: done["flag"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
