"""A whole simulated run of the queue from one seed: senders, consumers, trackers, faults, then the checks.

    python -m tests.sim.queue_scenario 1234          # run one seed, print what happened
    python -m tests.sim.queue_scenario 1234 --trace  # and the trace of every fault and process

The seed picks everything: one or two logical queues on one topic pair (their partitions), each
queue's limits (redelivery timeout, keep-alive interval, max in progress, max deliveries), the
inbox or not, how many consumers (and workers) and trackers, the messages (sent straight to Kafka
or through the outbox, some poison), how handlers behave (fail, ask to retry, take longer than the
redelivery timeout), and a schedule of faults until FAULTS_END: consumers and trackers crashing
between steps or at any call into Kafka or the database (inside a transaction, say), pausing
(past the group's session timeout: zombies), stopping gracefully, joining (rebalances);
transactions failing or timing out, markers' acknowledgements lost, the database failing commits
and dead letters; and, for some seeds, Kafka's transactions failing for good (a producer's fatal
error, a call that never returns) and the transaction coordinator away for a while (a broker
restarting). No process may end on its own through any of it. Then the run goes on until every
message is handled or dead-lettered (or a deadline passes). The invariants are
tests/sim/queue_checks.py's.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from functools import partial

from outbox.kafka.memory.broker import MemoryBroker, ProducerFaults
from outbox.kafka.memory.transactions import TransactionFaults
from outbox.kafka.memory.world import SimWorld
from outbox.queue import markers
from outbox.queue.config import QueueConfig, QueueLimits
from tests.sim import replay
from tests.sim.queue_checks import Ledger
from tests.sim.queue_process import App, AppFaults, ConsumerOptions, SimConsumer, SimTracker, TrackerOptions

FAULTS_END = 20.0
#: Long enough for a crash inside a transaction (the broker aborts it after at most 15 s), a
#: session timeout (10 s) and a few rounds of redeliveries.
DEADLINE = FAULTS_END + 150.0
QUEUES = ("emails", "reports")


@dataclass
class Result:
    seed: int
    ok: bool
    violation: str | None
    summary: str
    trace: list[str] = field(default_factory=list)


@dataclass
class QueueOptions:
    """What a mutation (tests/sim/queue_mutations.py) may change about a run."""

    consumer: ConsumerOptions = field(default_factory=ConsumerOptions)
    tracker: TrackerOptions = field(default_factory=TrackerOptions)
    #: Whether consumers use the inbox (None: the seed decides).
    inbox: bool | None = None


def limits_for(world: SimWorld) -> QueueLimits:
    rng = world.rng
    timeout = round(rng.uniform(1.0, 4.0), 3)
    interval = None if world.chance(0.5) else round(rng.uniform(timeout / 6, timeout / 2), 3)
    return QueueLimits(redelivery_timeout=timeout, keep_alive_interval=interval, max_in_progress=rng.randint(1, 12),
                       max_deliveries=rng.choice((None, 1, 2, 3, 5)))


def run(seed: int, options: QueueOptions | None = None, *, trace: bool = False) -> Result:
    options = options or QueueOptions()
    world = SimWorld(seed)
    world.keep_trace = trace
    rng = world.rng
    queues = list(QUEUES[:rng.randint(1, 2)])
    config = QueueConfig(base_kafka_config={"bootstrap.servers": "simulated:9092"}, topic="queue",
                         markers_topic="queue-markers", partitions=rng.randint(1, 6),
                         markers_partitions=rng.randint(1, 3), limits=limits_for(world),
                         per_queue={queue: limits_for(world) for queue in queues[1:]},
                         poll_interval=rng.choice((0.05, 0.1, 0.2)))
    assert not config.validate(), config.validate()
    broker = MemoryBroker(world, partitions=1)
    broker.create_topic(config.topic, config.partitions)
    broker.create_topic(config.markers_topic, config.markers_partitions, log_append_time=True)
    broker.transaction_timeout = rng.uniform(5.0, 15.0)  # 60 s in production (clients.py): scaled down
    txn_faults = TransactionFaults()
    app = App(world)
    ledger = Ledger(world, config, handled=app.handled)
    app.on_dead_letter = ledger.dead_lettered
    broker.watchers.append(ledger)
    inbox = options.inbox if options.inbox is not None else world.chance(0.5)
    # Markers a tracker reads per round: 1,000 in production, fewer here so that replays take rounds.
    fetch_batch = rng.choice((20, 100, 1000))
    consumers: list[SimConsumer] = []
    trackers: list[SimTracker] = []
    names = iter(range(1_000_000))
    rebuilt_seen: set[int] = set()

    def reader_position(producer: object, partition: int) -> int | None:
        for tracker in trackers:
            if producer in tracker.producers and tracker.consumers:
                return tracker.consumers[0].positions.get((config.markers_topic, partition))
        return None

    ledger.reader_position = reader_position

    def check_tracker(tracker: SimTracker) -> None:
        positions = {p: o for (topic, p), o in tracker.consumers[0].positions.items()}
        ledger.check_rebuilt(tracker.name, tracker.tracker._trackers, positions,
                             lambda p: broker.log(config.markers_topic)[p], rebuilt_seen)

    def spawn_consumer(queue: str, delay: float = 0.0) -> SimConsumer:
        limits = config.limits_for(queue)
        consumer = SimConsumer(world, f"c{next(names)}-{queue}", broker, txn_faults, config, queue, app,
                               workers=rng.randint(1, min(3, limits.max_in_progress)), inbox=inbox,
                               options=options.consumer)
        consumer.on_handed, consumer.fail = ledger.handed, ledger.fail
        consumers.append(consumer)
        world.after(delay, consumer.start)
        return consumer

    def spawn_tracker(delay: float = 0.0) -> SimTracker:
        tracker = SimTracker(world, f"t{next(names)}", broker, txn_faults, config, app, options.tracker)
        tracker.tracker.fetch_batch = fetch_batch
        tracker.after_step = check_tracker
        tracker.fail = ledger.fail
        trackers.append(tracker)
        world.after(delay, tracker.start)
        return tracker

    for queue in queues:
        for _ in range(rng.randint(1, 3)):
            spawn_consumer(queue, rng.uniform(0, 1.0))
    for _ in range(rng.randint(1, 3)):
        spawn_tracker(rng.uniform(0, 1.0))

    # -- senders: send() (the queue's name as key, a random partition) or stash() (through the outbox)
    total = rng.randint(20, 120)
    window = rng.uniform(1.0, 15.0)

    def send(number: int) -> None:
        queue = rng.choice(queues)
        message_id = f"m{number}"
        stashed = world.chance(0.3)
        key = f"{queue}/{message_id}" if stashed else queue
        partition = broker.partition_of(config.topic, key) if stashed else rng.randrange(config.partitions)
        if config.limits_for(queue).max_deliveries is not None and world.chance(0.05):
            app.poison.add(message_id)
        ledger.sent[message_id] = queue
        broker.append(config.topic, partition, key, b"payload",
                      markers.message_headers([("n", str(number).encode())], message_id=message_id, deliveries=1))

    for number in range(total):
        world.at(rng.uniform(0.2, window), lambda number=number: send(number))

    # -- faults -----------------------------------------------------------------------------------
    app.faults = AppFaults(commit_fails=rng.choice((0, 0.02, 0.1)), dead_letter_fails=rng.choice((0, 0.1)),
                           handler_fails=rng.choice((0, 0.03, 0.1)), handler_retries=rng.choice((0, 0.03)),
                           slow=rng.choice((0, 0.05, 0.15)))
    txn_faults.abortable = rng.choice((0, 0.02, 0.1))
    txn_faults.timeout = rng.choice((0, 0.02))
    txn_faults.timeout_committed = rng.choice((0, 0.01, 0.05))
    broker.faults = ProducerFaults(transient=rng.choice((0, 0.01, 0.05)), ack_lost=rng.choice((0, 0.01, 0.05)))

    def live_consumers() -> list[SimConsumer]:
        return [c for c in consumers if c.live()]

    def live_trackers() -> list[SimTracker]:
        return [t for t in trackers if t.live()]

    def fault() -> None:
        kind = rng.choice(("crash", "crash_in_call", "pause", "pause_long", "stop", "join"))
        process: SimConsumer | SimTracker
        if world.chance(0.6):
            if not live_consumers():
                return
            process = rng.choice(live_consumers())
            replace = lambda: spawn_consumer(process.queue, rng.uniform(0.2, 3.0))  # noqa: E731
        else:
            if not live_trackers():
                return
            process = rng.choice(live_trackers())
            replace = lambda: spawn_tracker(rng.uniform(0.2, 3.0))  # noqa: E731
        world.note(f"fault: {kind} on {process.name}")
        if kind == "crash":
            process.crash()
            replace()
        elif kind == "crash_in_call":
            process.crash(after_calls=rng.randint(0, 40))
            replace()
        elif kind == "pause":
            process.pause(rng.uniform(0.2, 3.0))
        elif kind == "pause_long":
            process.pause(rng.uniform(11.0, 20.0))  # past the session timeout (10 s): a zombie on resume
        elif kind == "stop":
            process.stop()
            replace()
        else:
            replace()

    for _ in range(rng.randint(0, 10)):
        world.at(rng.uniform(0.5, FAULTS_END - 1), fault)

    # Kafka's transactions failing for good, and the coordinator away: drawn from a generator of their own,
    # so that the seeds without them run as they did before these faults were modelled.
    kafka_rng = random.Random(f"{seed}/transactions")
    if kafka_rng.random() < 0.4:
        txn_faults.fatal = kafka_rng.choice((0, 0.02, 0.05))
        txn_faults.stuck = kafka_rng.choice((0, 0.01, 0.03))

        def coordinator_away(seconds: float) -> None:
            world.note(f"fault: the transaction coordinator away for {seconds:.2f}s")
            broker.coordinator_down_until = max(broker.coordinator_down_until, world.now + seconds)

        for _ in range(kafka_rng.randint(0, 3)):
            when, seconds = kafka_rng.uniform(0.5, FAULTS_END - 1), kafka_rng.uniform(0.5, 8.0)
            world.at(when, lambda seconds=seconds: coordinator_away(seconds))

    def calm() -> None:
        app.faults = AppFaults()
        txn_faults.abortable = txn_faults.timeout = txn_faults.timeout_committed = 0.0
        txn_faults.fatal = txn_faults.stuck = 0.0
        broker.faults = ProducerFaults()
        for queue in queues:
            if not any(c.queue == queue for c in live_consumers()):
                spawn_consumer(queue)
        if not live_trackers():
            spawn_tracker()

    world.at(FAULTS_END, calm)

    # -- run ----------------------------------------------------------------------------------------
    done = {"flag": False}

    def settled() -> bool:
        return len(ledger.sent) == total and all(m in app.handled or m in ledger.dead for m in ledger.sent)

    def watch() -> None:
        if settled():
            done["flag"] = True
            return
        world.after(1.0, watch)

    world.at(FAULTS_END, watch)

    def summary() -> str:
        limits = ", ".join(f"{q}: {config.limits_for(q).redelivery_timeout:g}s/{config.limits_for(q).max_in_progress}"
                           f"/{config.limits_for(q).max_deliveries}" for q in queues)
        return (f"seed {seed}: {len(queues)} queue(s) ({limits}), {total} messages ({len(app.poison)} poison), "
                f"inbox {'on' if inbox else 'off'}, partitions {config.partitions}/{config.markers_partitions}, "
                f"{len(consumers)} consumer and {len(trackers)} tracker incarnation(s)")

    try:
        world.run_until(DEADLINE, done=lambda: done["flag"] or ledger.violation is not None)
        if ledger.violation is None:
            ledger.check_settled(set())
    except AssertionError as violation:  # a Violation, or an assertion of the code under test
        text = ledger.violation or f"t={world.now:.3f}: {violation}"
        return Result(seed, False, text, summary(), world.trace)
    if ledger.violation is not None:
        return Result(seed, False, ledger.violation, summary(), world.trace)
    text = (f"{summary()}; {sum(app.handled.values())} handled, {len(ledger.dead)} dead-lettered, "
            f"{ledger.redelivered} ended by trackers, done at t={world.now:.1f}")
    return Result(seed, True, None, text, world.trace)


#: run(), for a pool of processes: (seed, violation or None, summary).
run_quietly = partial(replay.quietly, run)


def main(argv: list[str]) -> int:
    return replay.main(argv, run, __doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
