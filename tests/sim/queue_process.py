"""Simulated queue processes: `manage.py outbox_consume` and `manage.py outbox_redeliver`, running the
real QueueConsumer (with its ConsumerState), the real handling of a handler's outcome
(outbox/queue/handling.py) and the real RedeliveryTracker (with its tracker_state), over the
in-memory Kafka (outbox/kafka/memory/) on the world's clock.

Each thread of the real process is a chain of world events calling the same method its thread
calls in a loop: the fetcher `QueueConsumer.fetch()`, the keep-alive thread `keep_alive()`, each
worker `receive()` and, a handler's duration later, `handling.handle()`; the tracker's thread
`RedeliveryTracker.step()`. A poll that finds nothing waits its timeout (the memory consumer says
how long); a worker that received nothing waits until the fetcher has buffered a batch; the
process's monotonic clock has an origin of its own.

A process can crash (SIGKILL) between two steps or at its n-th call into a client, the dead-letter
sink or the database (inside a Kafka transaction, say: the broker aborts it after the transaction
timeout), pause (SIGSTOP: nothing runs, Kafka stops hearing from it) and stop gracefully (SIGTERM:
the workers finish the message in hand, then the steps of QueueConsumer.close()).

A step that raises ends its process, as the real thread's failure ends the command: nothing the
simulated Kafka does (a producer failing fatally, a coordinator away) may do that, so it is a
violation. A process that cannot start (its open() refused while the transaction coordinator is
away) is started again a second later, as its service manager would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from outbox.kafka.memory.broker import MemoryBroker, MemoryProducer
from outbox.kafka.memory.consumer import MemoryConsumer
from outbox.kafka.memory.transactions import TransactionalProducer, TransactionFaults
from outbox.kafka.memory.world import SimWorld
from outbox.queue import handling
from outbox.queue.config import QueueConfig, QueueLimits
from outbox.queue.errors import QueueError, Retry
from outbox.queue.markers_consumer import Message, QueueConsumer
from outbox.queue.tracker import DeadLetter, RedeliveryTracker
from outbox.queue.transactional import call_at_once

#: A process that could not start is started again this much later (its service manager's restart delay).
RESTART_DELAY = 1.0


class ProcessCrashed(BaseException):
    """The process died at this point; raised from a client call, it unwinds the step that made it."""


class DatabaseFailed(Exception):
    """A statement or a commit of the application's database failed."""


@dataclass
class AppFaults:
    commit_fails: float = 0.0  # the handler's transaction fails at its commit
    dead_letter_fails: float = 0.0  # the dead-letter sink fails
    handler_fails: float = 0.0  # a handler raises (the message is abandoned)
    handler_retries: float = 0.0  # a handler raises Retry
    slow: float = 0.0  # a handler takes longer than the redelivery timeout


@dataclass
class App:
    """The application's database: what handlers committed, the inbox, the dead letters."""

    world: SimWorld
    faults: AppFaults = field(default_factory=AppFaults)
    #: message id -> times its handler's work committed
    handled: dict[str, int] = field(default_factory=dict)
    inbox: set[tuple[str, str]] = field(default_factory=set)
    dead: dict[str, DeadLetter] = field(default_factory=dict)
    #: Messages whose handler always fails (until max_deliveries sends them to the dead letters).
    poison: set[str] = field(default_factory=set)
    #: Called with each dead letter stored (the checks).
    on_dead_letter: Callable[[DeadLetter], None] = lambda letter: None


class SimInbox:
    """handling.Inbox over the App's database: the inbox row and the handler's work commit together."""

    def __init__(self, process: SimProcess, app: App) -> None:
        self.process, self.app = process, app
        self._rows: list[tuple[str, str]] | None = None
        self._work: list[str] = []

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        self._rows, self._work = [], []
        try:
            yield
            self.process.checkpoint()  # the commit: the process may die in it (committed or not, it never learns)
            if self.app.world.chance(self.app.faults.commit_fails):
                raise DatabaseFailed("the commit failed")
            self.app.inbox.update(self._rows)
            for message_id in self._work:
                self.app.handled[message_id] = self.app.handled.get(message_id, 0) + 1
        finally:
            self._rows = None

    def claim(self, queue: str, message_id: str) -> bool:
        self.process.checkpoint()
        assert self._rows is not None, "claim() outside atomic()"
        if (queue, message_id) in self.app.inbox:
            return False
        self._rows.append((queue, message_id))
        return True

    def work(self, message_id: str) -> None:
        """The handler's own write: in the transaction if there is one."""
        if self._rows is not None:
            self._work.append(message_id)
        else:
            self.app.handled[message_id] = self.app.handled.get(message_id, 0) + 1


class MarkerProducer(MemoryProducer):
    """The consumer's marker producer: idempotent, and a crash point."""

    def __init__(self, broker: MemoryBroker, process: SimProcess) -> None:
        super().__init__(broker, process.name, is_running=process.running)
        self.process = process

    def produce(self, *args: Any, **kwargs: Any) -> None:
        self.process.checkpoint()
        super().produce(*args, **kwargs)


class SimProcess:
    def __init__(self, world: SimWorld, name: str, broker: MemoryBroker, txn_faults: TransactionFaults) -> None:
        self.world, self.name, self.broker, self.txn_faults = world, name, broker, txn_faults
        self.started = self.crashed = self.ended = self.stopping = False
        self.paused_until = 0.0
        self._origin = world.rng.uniform(-1e4, 1e4)  # a monotonic clock starts anywhere
        self._crash_in: int | None = None
        self.producers: list[Any] = []
        self.consumers: list[MemoryConsumer] = []
        #: Reports a broken invariant (the checks').
        self.fail: Callable[[str], None] = lambda text: None

    # -- the process ------------------------------------------------------------------------------

    def clock(self) -> float:
        return self.world.now + self._origin

    def running(self) -> bool:
        return self.started and not self.crashed and not self.ended and self.world.now >= self.paused_until

    def live(self) -> bool:
        return self.started and not self.crashed and not self.ended and not self.stopping

    def checkpoint(self) -> None:
        """Every call into a client or a database passes here: an armed crash happens at one of them."""
        if self.crashed:
            raise ProcessCrashed
        if self._crash_in is not None:
            if self._crash_in <= 0:
                self.crash()
                raise ProcessCrashed
            self._crash_in -= 1

    def crash(self, after_calls: int | None = None) -> None:
        """SIGKILL, now or at the n-th call from now: memory is gone; Kafka notices after the session timeout."""
        if not self.started or self.crashed or self.ended:
            return
        if after_calls is not None:
            self._crash_in = after_calls
            return
        self.world.note(f"{self.name} crashed")
        self.crashed = True
        for producer in self.producers:
            if isinstance(producer, MemoryProducer):
                producer.purge()  # what was not on the wire is gone; what was lands or not
                producer.close()

    def pause(self, seconds: float) -> None:
        if self.running():
            self.world.note(f"{self.name} paused for {seconds:.2f}s")
            self.paused_until = self.world.now + seconds

    def thread(self, step: Callable[[], float | None], delay: float = 0.0) -> None:
        """A thread: `step` runs when the process runs, again after the delay it returns (None: the thread ends)."""
        def run() -> None:
            if self.crashed or self.ended:
                return
            if not self.running():
                self.world.at(self.paused_until, run)
                return
            try:
                again = step()
            except ProcessCrashed:
                return
            except Exception as error:  # the thread dies, and with it the command (its _fail())
                self.ended = True
                self.world.note(f"{self.name} ended: {error!r}")
                self.fail(f"{self.name} ended on its own: {error!r}")
                return
            if again is not None:
                self.world.after(again, run)
        self.world.after(delay, run)

    # -- its clients ------------------------------------------------------------------------------

    def kafka_consumer(self, config: dict[str, Any]) -> MemoryConsumer:
        consumer = MemoryConsumer(self.broker, config, name=self.name, alive=self.running, checkpoint=self.checkpoint)
        self.consumers.append(consumer)
        return consumer

    def kafka_producer(self, config: dict[str, Any]) -> Any:
        producer: Any
        if "transactional.id" in config:
            producer = TransactionalProducer(self.broker, config, faults=self.txn_faults, checkpoint=self.checkpoint)
        else:
            producer = MarkerProducer(self.broker, self)
        self.producers.append(producer)
        return producer

    def blocked(self) -> float:
        """How long the last step's polls waited for nothing (and forget it)."""
        waited = 0.0
        for consumer in self.consumers:
            waited += consumer.blocked
            consumer.blocked = 0.0
        return waited


@dataclass
class ConsumerOptions:
    """What a mutation (tests/sim/queue_mutations.py) may change about a consumer process."""

    consumer_class: type[QueueConsumer] = QueueConsumer
    handle: Callable[..., handling.Outcome] = handling.handle


class SimConsumer(SimProcess):
    """`manage.py outbox_consume --queue Q [--inbox] --workers N` with a handler that does some work."""

    def __init__(self, world: SimWorld, name: str, broker: MemoryBroker, txn_faults: TransactionFaults,
                 config: QueueConfig, queue: str, app: App, *, workers: int, inbox: bool,
                 options: ConsumerOptions) -> None:
        super().__init__(world, name, broker, txn_faults)
        self.queue, self.app, self.workers, self.options = queue, app, workers, options
        self.limits: QueueLimits = config.limits_for(queue)
        self.consumer = options.consumer_class(config, queue, name=name, consumer_factory=self.kafka_consumer,
                                               producer_factory=self.kafka_producer, clock=self.clock,
                                               create_topics=lambda *_: None, caller=call_at_once)
        self.inbox = SimInbox(self, app)
        self.use_inbox = inbox
        self._busy = 0  # workers with a message in hand
        self._idle = 0  # workers waiting in receive()
        self._started = 0
        #: Told of every message a handler is given (the checks).
        self.on_handed: Callable[[str, str, int], None] = lambda consumer, message_id, deliveries: None

    def start(self) -> None:
        self.started = True
        if self.crashed or self.ended:
            return
        try:
            self.consumer.open()
        except ProcessCrashed:
            return
        except QueueError as error:
            self.world.note(f"{self.name} could not start ({error}): started again in {RESTART_DELAY:g}s")
            self.world.after(RESTART_DELAY, self.start)
            return
        self.world.note(f"{self.name} consuming {self.queue}")
        self.thread(self._fetch)
        self.thread(self._keep_alive)
        for _ in range(self.workers):
            self.thread(self._work)

    def stop(self) -> None:
        """SIGTERM: the workers finish the message in hand; then QueueConsumer.close()'s steps."""
        if self.live():
            self.world.note(f"{self.name} stopping")
            self.stopping = True
            self.thread(self._close_when_idle)

    def _fetch(self) -> float | None:
        if self.consumer._closed:
            return None
        wait = self.consumer.fetch()
        if self._idle and self.consumer.started != self._started:  # a batch came: receive() returns
            self._started = self.consumer.started
            for _ in range(self._idle):
                self.thread(self._work)
            self._idle = 0
        if self.consumer.in_progress > self.limits.max_in_progress:
            self.fail(f"{self.name} holds {self.consumer.in_progress} messages (max_in_progress "
                      f"{self.limits.max_in_progress})")
        return max(wait.seconds, self.blocked(), 0.001)

    def _keep_alive(self) -> float | None:
        if self.consumer._closed and not self.consumer.in_progress:
            return None
        self.consumer.keep_alive()
        interval = self.limits.keep_alive_interval
        assert interval is not None
        return min(interval / 4, 0.5)

    def _work(self) -> float | None:
        if self.stopping:
            return None
        message = self.consumer.receive(timeout=0)
        if message is None:
            self._idle += 1  # waits in receive() until a batch is buffered
            self._started = self.consumer.started
            return None
        self._busy += 1
        self.on_handed(self.name, message.id, message.deliveries)
        faults = self.app.faults
        slow = self.world.chance(faults.slow)
        duration = self.world.rng.uniform(1.2, 3.0) * self.limits.redelivery_timeout if slow \
            else self.world.rng.uniform(0.001, 0.05)
        self.world.after(duration, lambda: self._finish(message))
        return None

    def _finish(self, message: Message) -> None:
        """The handler returns (or raises) and the real handling settles the message."""
        if self.crashed or self.ended:
            return
        if not self.running():
            self.world.at(self.paused_until, lambda: self._finish(message))
            return
        try:
            outcome = self.options.handle(message, self._handler, self.inbox if self.use_inbox else None)
        except ProcessCrashed:
            return
        if self.world.keep_trace:
            self.world.note(f"{self.name}: {message.id} delivery {message.deliveries} at {message.ref}: "
                            f"{outcome.value}")
        self._busy -= 1
        self.thread(self._work)

    def _handler(self, message: Message) -> None:
        self.checkpoint()
        faults, world = self.app.faults, self.world
        if message.id in self.app.poison or world.chance(faults.handler_fails):
            raise DatabaseFailed("the handler failed")
        if world.chance(faults.handler_retries):
            raise Retry("not now", delay=world.rng.uniform(0.0, 1.0))
        self.inbox.work(message.id)

    def _close_when_idle(self) -> float | None:
        if self._busy:
            return 0.05
        consumer = self.consumer
        consumer.stop_fetching()
        consumer.leave()
        consumer.release()
        consumer.drop_held()  # the workers are done: nothing received is left
        consumer.close_clients()
        flushed_by = self.world.now + 10

        def flushed() -> float | None:
            """close_clients() flushes the marker producer (up to 10 s); then the process exits."""
            if any(len(p) for p in self.producers) and self.world.now < flushed_by:
                return 0.01
            self._exit()
            return None
        self.thread(flushed)
        return None

    def _exit(self) -> None:
        self.ended = True
        self.world.note(f"{self.name} stopped")
        return None


@dataclass
class TrackerOptions:
    tracker_class: type[RedeliveryTracker] = RedeliveryTracker


class SimTracker(SimProcess):
    """`manage.py outbox_redeliver`, its dead letters stored in the App's database."""

    def __init__(self, world: SimWorld, name: str, broker: MemoryBroker, txn_faults: TransactionFaults,
                 config: QueueConfig, app: App, options: TrackerOptions) -> None:
        super().__init__(world, name, broker, txn_faults)
        self.app = app
        self.tracker = options.tracker_class(config, dead_letters=self._store_dead_letters, name=name,
                                             consumer_factory=self.kafka_consumer,
                                             producer_factory=self.kafka_producer, clock=self.clock,
                                             create_topics=lambda *_: None, caller=call_at_once)
        #: Called after each step (the checks look at what the tracker rebuilt).
        self.after_step: Callable[[SimTracker], None] = lambda tracker: None

    def start(self) -> None:
        self.started = True
        if self.crashed or self.ended:
            return
        try:
            self.tracker.open()
        except ProcessCrashed:
            return
        except QueueError as error:
            self.world.note(f"{self.name} could not start ({error}): started again in {RESTART_DELAY:g}s")
            self.world.after(RESTART_DELAY, self.start)
            return
        self.world.note(f"{self.name} tracking")
        self.thread(self._step)

    def stop(self) -> None:
        if self.live():
            self.world.note(f"{self.name} stopping")
            self.stopping = True
            self.tracker.stop()

    def _step(self) -> float | None:
        if self.stopping:
            self.tracker.close()
            self.ended = True
            self.world.note(f"{self.name} stopped")
            return None
        self.tracker.step()
        self.after_step(self)
        return max(self.blocked(), 0.001)

    def _store_dead_letters(self, letters: list[DeadLetter]) -> None:
        self.checkpoint()
        if self.world.chance(self.app.faults.dead_letter_fails):
            raise DatabaseFailed("the dead letters could not be stored")
        for letter in letters:
            if letter.message_id not in self.app.dead:  # idempotent per message id
                self.app.dead[letter.message_id] = letter
                self.app.on_dead_letter(letter)
