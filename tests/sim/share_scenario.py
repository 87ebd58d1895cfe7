"""A whole simulated run of a share queue from one seed: senders, consumers, faults, then the checks.

    python -m tests.sim.share_scenario 1234          # run one seed, print what happened
    python -m tests.sim.share_scenario 1234 --trace  # and the trace of every fault and process

The seed picks the queue's limits (lock 1-4 s, max in progress, max_deliveries 1-9), the broker's
delivery-count limit (above max_deliveries, at most 10), the share topic's partitions, the inbox or
not, how many consumers (and workers), how far librdkafka's soft max.poll.records overshoots, the
messages (some poison), how handlers behave (fail, ask to Retry(delay), outlast the lock), and a
schedule of faults until FAULTS_END: consumers crashing between steps or at any call into the
client, the dead-letter sink or the database, pausing (past the lock; past the session timeout),
stopping gracefully, joining; acknowledgement requests failing, dead letters and the handlers'
commits failing. Then calm until every message is handled or dead-lettered (or a deadline passes).
The invariants are tests/sim/share_checks.py's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from functools import partial

from outbox.kafka.memory.broker import MemoryBroker
from outbox.kafka.memory.share_groups import share_group
from outbox.kafka.memory.world import SimWorld
from outbox.queue import markers
from outbox.queue.config import QueueConfig, QueueLimits
from tests.sim import replay
from tests.sim.queue_process import App, AppFaults
from tests.sim.share_checks import ShareLedger
from tests.sim.share_process import ShareFaults, ShareOptions, SimShareConsumer

FAULTS_END = 20.0
#: Long enough for a session timeout (10 s) and a few rounds of locks (at most 4 s) after the faults.
DEADLINE = FAULTS_END + 120.0
QUEUE = "emails"
#: Seeds that found bugs in the share backend (docs/simulation.md), run with every test of these runs.
REGRESSIONS: dict[int, str] = {
    10: "an immediate verdict meant local time 0.0: on a clock below 0 every acknowledgement waited for 0",
    134: "a dead letter that could not be written was RELEASEd at once: twice on the last deliveries, and the "
         "broker's delivery limit archived the record unseen",
    285: "a Retry's delayed RELEASE was capped by a lock counted from receive(), not from the fetch: held past the "
         "lock",
}


@dataclass
class Result:
    seed: int
    ok: bool
    violation: str | None
    summary: str
    trace: list[str] = field(default_factory=list)


def run(seed: int, options: ShareOptions | None = None, *, trace: bool = False) -> Result:
    options = options or ShareOptions()
    world = SimWorld(seed)
    world.keep_trace = trace
    rng = world.rng
    limits = QueueLimits(redelivery_timeout=round(rng.uniform(1.0, 4.0), 3), max_in_progress=rng.randint(1, 12),
                         max_deliveries=rng.choice((1, 2, 3, 5, 9)), backend="share")
    assert limits.max_deliveries is not None
    config = QueueConfig(base_kafka_config={"bootstrap.servers": "simulated:9092"}, topic="queue",
                         markers_topic="queue-markers", partitions=rng.randint(1, 6), limits=limits,
                         poll_interval=rng.choice((0.05, 0.1, 0.2)))
    assert not config.validate() and not limits.problems(), (config.validate(), limits.problems())
    broker = MemoryBroker(world, partitions=1)
    topic = config.share_topic(QUEUE)
    broker.create_topic(topic, config.partitions)
    group = share_group(broker, config.share_group(QUEUE), topic)
    group.delivery_limit = rng.randint(limits.max_deliveries + 1, 10)
    app = App(world)
    ledger = ShareLedger(world, limits.max_deliveries, app.handled, app.dead)
    app.on_dead_letter = ledger.dead_lettered
    group.watchers.append(ledger)
    inbox = world.chance(0.5)
    faults = ShareFaults(overfetch=rng.choice((1, 1, 3, 10)), ack_lost=rng.choice((0, 0.02, 0.1)))
    consumers: list[SimShareConsumer] = []
    names = iter(range(1_000_000))
    ledger.steady = lambda name, since: any(c.name == name and c.steady(since) for c in consumers)

    def spawn(delay: float = 0.0) -> SimShareConsumer:
        consumer = SimShareConsumer(world, f"c{next(names)}", broker, config, QUEUE, app,
                                    workers=rng.randint(1, min(3, limits.max_in_progress)), inbox=inbox,
                                    faults=faults, options=options)
        consumer.on_handed, consumer.on_outcome = ledger.handed, ledger.outcome
        consumer.on_letters_failed = ledger.letters_not_written
        consumers.append(consumer)
        world.after(delay, consumer.start)
        return consumer

    for _ in range(rng.randint(1, 4)):
        spawn(rng.uniform(0, 1.0))

    # -- senders: send() to the share topic (the queue's name as key, a random partition), or stash()
    total = rng.randint(20, 120)
    window = rng.uniform(0.0, 15.0)

    def send(number: int) -> None:
        message_id = f"m{number}"
        stashed = world.chance(0.3)
        key = f"{QUEUE}/{message_id}" if stashed else QUEUE
        partition = broker.partition_of(topic, key) if stashed else rng.randrange(config.partitions)
        if world.chance(0.05):
            app.poison.add(message_id)
        record = broker.append(topic, partition, key, b"payload",
                               markers.message_headers([("n", str(number).encode())], message_id=message_id,
                                                       deliveries=1))
        ledger.sent[message_id] = (partition, record.offset())

    for number in range(total):
        world.at(rng.uniform(0.0, window), lambda number=number: send(number))

    # -- faults -----------------------------------------------------------------------------------
    app.faults = AppFaults(commit_fails=rng.choice((0, 0.02, 0.1)), dead_letter_fails=rng.choice((0, 0.1, 0.3)),
                           handler_fails=rng.choice((0, 0.03, 0.1)), handler_retries=rng.choice((0, 0.03, 0.1)),
                           slow=rng.choice((0, 0.05, 0.15)))

    def live() -> list[SimShareConsumer]:
        return [c for c in consumers if c.live()]

    def fault() -> None:
        kind = rng.choice(("crash", "crash_in_call", "pause", "pause_long", "stop", "join"))
        if not live():
            return
        process = rng.choice(live())
        world.note(f"fault: {kind} on {process.name}")
        if kind == "crash":
            process.crash()
            spawn(rng.uniform(0.2, 3.0))
        elif kind == "crash_in_call":
            process.crash(after_calls=rng.randint(0, 40))
            spawn(rng.uniform(0.2, 3.0))
        elif kind == "pause":
            process.pause(rng.uniform(0.2, 1.5) * limits.redelivery_timeout)  # past the lock, now and then
        elif kind == "pause_long":
            process.pause(rng.uniform(11.0, 20.0))  # past the session timeout (10 s): dropped, rejoins on resume
        elif kind == "stop":
            process.stop()
            spawn(rng.uniform(0.2, 3.0))
        else:
            spawn()

    for _ in range(rng.randint(0, 10)):
        world.at(rng.uniform(0.5, FAULTS_END - 1), fault)

    def calm() -> None:
        app.faults = AppFaults()
        faults.ack_lost = 0.0
        if not live():
            spawn()

    world.at(FAULTS_END, calm)

    # -- run ----------------------------------------------------------------------------------------
    done = {"flag": False}

    def watch() -> None:
        if len(ledger.sent) == total and all(m in app.handled or m in app.dead or m in ledger.unseen
                                             for m in ledger.sent):
            done["flag"] = True
            return
        world.after(1.0, watch)

    world.at(FAULTS_END, watch)

    def summary() -> str:
        return (f"seed {seed}: share queue (lock {limits.redelivery_timeout:g}s, max_in_progress "
                f"{limits.max_in_progress} (x{faults.overfetch}), max_deliveries {limits.max_deliveries}, broker "
                f"limit {group.delivery_limit}), {total} messages ({len(app.poison)} poison), inbox "
                f"{'on' if inbox else 'off'}, {config.partitions} partition(s), {len(consumers)} consumer "
                f"incarnation(s)")

    try:
        world.run_until(DEADLINE, done=lambda: done["flag"] or ledger.violation is not None)
        if ledger.violation is None:
            ledger.check_settled()
    except AssertionError as violation:  # a Violation, or an assertion of the code under test
        text = ledger.violation or f"t={world.now:.3f}: {violation}"
        return Result(seed, False, text, summary(), world.trace)
    except Exception as error:  # the real consumer would fail (and outbox_consume exit 1)
        return Result(seed, False, f"t={world.now:.3f}: the consumer failed: {error!r}", summary(), world.trace)
    if ledger.violation is not None:
        return Result(seed, False, ledger.violation, summary(), world.trace)
    text = (f"{summary()}; {sum(app.handled.values())} handled, {len(app.dead)} dead-lettered, "
            f"{ledger.refused} acknowledgements refused, {len(ledger.unseen)} archived unseen at the broker's limit "
            f"(every delivery past max_deliveries ended with no dead letter possible), done at t={world.now:.1f}")
    return Result(seed, True, None, text, world.trace)


#: run(), for a pool of processes: (seed, violation or None, summary).
run_quietly = partial(replay.quietly, run)


def main(argv: list[str]) -> int:
    return replay.main(argv, run, __doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
