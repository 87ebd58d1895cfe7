"""A simulated `manage.py outbox_consume` on a share queue: the real ShareQueueConsumer (its poller's
round(), with share_state.py's decisions), the real handling of a handler's outcome (handling.py,
the inbox's transaction) over the memory share group (outbox/kafka/memory/share_groups.py), on the
world's clock.

The poller thread is a chain of world events calling ShareQueueConsumer.round(), as _poll_loop does,
until polling_done; the consumer's condition variable is swapped for one that never blocks: a wait
becomes the delay to the next round, and a notify (a message settled, a batch buffered) wakes the
poller and the idle workers at once, as the real one does. Each worker calls receive() and, a
handler's duration later, handling.handle(). The process crashes (at any call into the client, the
dead-letter sink or the database), pauses, and stops as outbox_consume does on SIGTERM: the workers
finish the message in hand, then close()'s steps (stop_polling(), rounds until every record of the
batch is acknowledged, the client's close, which leaves the group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from outbox.kafka.memory.broker import MemoryBroker
from outbox.kafka.memory.share_consumer import MemoryShareConsumer
from outbox.kafka.memory.share_groups import share_group
from outbox.kafka.memory.world import SimWorld
from outbox.queue import handling
from outbox.queue.config import QueueConfig, QueueLimits
from outbox.queue.errors import QueueError, Retry
from outbox.queue.markers_consumer import Message
from outbox.queue.share_consumer import ShareQueueConsumer
from outbox.queue.share_session import failure_detection
from outbox.queue.share_state import group_settings
from outbox.queue.tracker import DeadLetter
from tests.sim.queue_process import App, DatabaseFailed, ProcessCrashed, SimInbox, SimProcess


class SimCondition:
    """threading.Condition for a simulated process: never blocks; `waited` is the last wait asked for."""

    def __init__(self, notified: Callable[[], None]) -> None:
        self.notified = notified
        self.waited = 0.0

    def __enter__(self) -> SimCondition:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def wait(self, timeout: float | None = None) -> bool:
        self.waited = timeout or 0.0
        return False

    def notify_all(self) -> None:
        self.notified()


@dataclass
class ShareFaults:
    """The client's and the broker's faults, for a run."""

    #: librdkafka's max.poll.records is soft: a poll may bring this many times more.
    overfetch: int = 1
    #: An acknowledgement request fails (the records come back when their locks end).
    ack_lost: float = 0.0
    #: A fetch's answer takes up to this long to reach the client (the locks started at the broker).
    fetch_latency: float = 0.05


@dataclass
class ShareOptions:
    """What a mutation (tests/sim/share_mutations.py) may change about a consumer process."""

    consumer_class: type[ShareQueueConsumer] = ShareQueueConsumer
    handle: Callable[..., handling.Outcome] = handling.handle
    group_settings: Callable[[QueueLimits], dict[str, str]] = group_settings


class SimShareConsumer(SimProcess):
    """`manage.py outbox_consume --queue Q [--inbox] --workers N` on a share queue."""

    def __init__(self, world: SimWorld, name: str, broker: MemoryBroker, config: QueueConfig, queue: str, app: App,
                 *, workers: int, inbox: bool, faults: ShareFaults, options: ShareOptions) -> None:
        super().__init__(world, name, broker, txn_faults=None)  # type: ignore[arg-type]  # no transactions here
        self.queue, self.app, self.workers, self.faults, self.options = queue, app, workers, faults, options
        self.limits: QueueLimits = config.limits_for(queue)
        self.consumer = options.consumer_class(config, queue, dead_letters=self._store_dead_letters, name=name,
                                               consumer_factory=self._client, clock=self.clock, prepare=self._prepare)
        self._condition = SimCondition(self._notified)
        self.consumer._lock = self.consumer._changed = self._condition  # type: ignore[assignment]
        self.inbox = SimInbox(self, app)
        self.use_inbox = inbox
        self._busy = 0  # workers with a message in hand
        self._idle = 0  # workers waiting in receive()
        self._poller_waiting = False
        self._in_round = False
        self._poll_token = 0
        #: (from, to) of each pause: the checks exempt what a paused process could not do in time.
        self.pauses: list[tuple[float, float]] = []
        #: Told of every message a handler is given, and of what its handling came to (the checks).
        self.on_handed: Callable[[str, Message], None] = lambda consumer, message: None
        self.on_outcome: Callable[[Message, handling.Outcome], None] = lambda message, outcome: None
        self.on_letters_failed: Callable[[Sequence[DeadLetter]], None] = lambda letters: None

    # -- the clients ------------------------------------------------------------------------------

    def _prepare(self, config: QueueConfig, queue: str, limits: QueueLimits, timeout: float) -> None:
        """share_group.py's set-up, against the memory broker: the topic, then the group's configuration."""
        self.checkpoint()
        topic = config.share_topic(queue)
        if topic not in self.broker.topics:
            self.broker.create_topic(topic, config.partitions)
        group = share_group(self.broker, config.share_group(queue), topic)
        group.config.update(self.options.group_settings(limits))
        group.config.update(failure_detection(limits.redelivery_timeout).settings)

    def _client(self, config: dict[str, Any]) -> MemoryShareConsumer:
        faults, world = self.faults, self.world
        return MemoryShareConsumer(
            self.broker, config, name=self.name, alive=self.running, checkpoint=self.checkpoint,
            fetch_limit=lambda most: most * world.rng.randint(1, faults.overfetch),
            ack_lost=lambda: world.chance(faults.ack_lost),
            acquired_ago=lambda: world.latency(0.0, faults.fetch_latency))

    def _store_dead_letters(self, letters: Sequence[DeadLetter]) -> None:
        self.checkpoint()
        if self.world.chance(self.app.faults.dead_letter_fails):
            self.on_letters_failed(letters)
            raise DatabaseFailed("the dead letters could not be stored")
        for letter in letters:
            if letter.message_id not in self.app.dead:  # idempotent per message id
                self.app.dead[letter.message_id] = letter
            self.app.on_dead_letter(letter)

    def blocked(self) -> float:
        client = self.consumer._consumer
        if not isinstance(client, MemoryShareConsumer):
            return 0.0
        waited, client.blocked = client.blocked, 0.0
        return waited

    # -- the process ------------------------------------------------------------------------------

    def pause(self, seconds: float) -> None:
        if self.running():
            self.pauses.append((self.world.now, self.world.now + seconds))
        super().pause(seconds)

    def steady(self, since: float) -> bool:
        """Running, neither paused nor crashed, since `since`."""
        return not self.crashed and not any(end > since for _, end in self.pauses)

    def start(self) -> None:
        self.started = True
        try:
            self.consumer.open()
        except ProcessCrashed:
            return
        self.world.note(f"{self.name} consuming share queue {self.queue}")
        self._schedule_poll(0.0)
        for _ in range(self.workers):
            self.thread(self._work)

    def stop(self) -> None:
        """SIGTERM: the workers finish the message in hand; then close()'s steps."""
        if self.live():
            self.world.note(f"{self.name} stopping")
            self.stopping = True
            self.thread(self._close_when_idle)

    def _close_when_idle(self) -> float | None:
        if self._busy:
            return 0.05
        self.consumer.stop_polling()
        return None

    def _notified(self) -> None:
        """The condition was notified: idle workers look again, a waiting poller runs its next round now."""
        idle, self._idle = self._idle, 0
        for _ in range(idle):
            self.thread(self._work)
        if self._poller_waiting and not self._in_round:
            self._schedule_poll(0.0)

    def _schedule_poll(self, delay: float) -> None:
        self._poll_token += 1
        token = self._poll_token
        self._poller_waiting = delay > 0

        def step() -> float | None:
            if token != self._poll_token:
                return None  # woken earlier by a notify: that chain runs on
            return self._poll_step()
        self.thread(lambda: self._again(step()), delay)

    def _again(self, delay: float | None) -> None:
        if delay is not None:
            self._schedule_poll(delay)
        return None

    def _poll_step(self) -> float | None:
        """One pass of ShareQueueConsumer._poll_loop: a round, or the client's close once polling is done."""
        consumer = self.consumer
        if consumer.polling_done:
            consumer._close_client()
            self.ended = True
            self.world.note(f"{self.name} stopped")
            return None
        self._condition.waited = 0.0
        self._in_round = True
        try:
            consumer.round()
        finally:
            self._in_round = False
        return max(self._condition.waited, self.blocked(), 0.001)

    def _work(self) -> float | None:
        if self.stopping:
            return None
        try:
            message = self.consumer.receive(timeout=0)
        except QueueError:
            return None  # closed
        if message is None:
            self._idle += 1  # waits in receive() until the poller notifies
            return None
        self._busy += 1
        self.on_handed(self.name, message)
        slow = self.world.chance(self.app.faults.slow)
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
        self.on_outcome(message, outcome)
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
            raise Retry("not now", delay=world.rng.uniform(0.0, 1.5) * self.limits.redelivery_timeout)
        self.inbox.work(message.id)
