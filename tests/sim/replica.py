"""One simulated harvester process: the real Core, driven the way harvester.py drives it.

The process can be paused (SIGSTOP: nothing runs, librdkafka included), crash (its database
sessions end, its group membership times out), stop gracefully, and lose its network to Kafka's
leader-election broker, to the record brokers, or to Postgres.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from outbox.harvest import commands as cmd
from outbox.harvest import events
from outbox.harvest.commands import DeliveryError
from outbox.harvest.config import Limits
from outbox.harvest.core import Core
from tests.sim.kafka import Group, Member, SimKafka, SimProducer
from tests.sim.table import Session, SimTable, StatementFailed
from tests.sim.world import Violation, World


@dataclass
class Links:
    leader: bool = True  # to the leader topic's broker and the group coordinator
    records: bool = True  # to the brokers of the record topic
    database: bool = True


@dataclass
class Log:
    """What the run's checks need from every replica."""

    leader_ids: list[tuple[str, object]] = field(default_factory=list)
    events: list[tuple[float, str, str]] = field(default_factory=list)


class SimReplica:
    def __init__(self, world: World, name: str, group: str, limits: Limits, kafka: SimKafka, table: SimTable,
                 log: Log, *, park_after: int | None = None,
                 core_factory: Callable[..., Core] = Core) -> None:
        self.world = world
        self.name = name
        self.group_name = group
        self.limits = limits
        self.kafka = kafka
        self.table = table
        self.log = log
        self.running = False
        self.crashed = False
        self.stopped = False
        self.paused_until = 0.0
        self.links = Links()
        self.slow_until = 0.0  # its database statements crawl until then
        self.core = core_factory(limits, new_leader_id=world.uuid, park_after=park_after, now=world.now)
        self.core.checking = True
        self.group: Group = kafka.group(group, 3 * limits.heartbeat_timeout)
        self.member = Member(name, alive=lambda: self.process_running() and self.links.leader)
        self.fence = Session(name, group)
        self.purger = Session(name, group)
        self._fence_busy_until = 0.0
        self._purge_busy_until = 0.0
        self.producer = self._new_producer()
        self._retiring: list[SimProducer] = []
        self._inbox: list[Callable[[], None]] = []
        self._wake_at: float | None = None
        self._next_poll = 0.0
        self._signature = f"{name}:{world.rng.getrandbits(32)}"
        self._heartbeat_offset = 0
        self._stop_deadline: float | None = None
        self._last_turn = -1.0
        self._spins = 0

    # -- the process ----------------------------------------------------------------------------

    def process_running(self) -> bool:
        return self.running and not self.crashed and self.world.now >= self.paused_until

    def start(self) -> None:
        self.running = True
        self.group.join(self.member)
        self._wake(0.0)

    def pause(self, seconds: float) -> None:
        """SIGSTOP for `seconds`, then SIGCONT."""
        if not self.process_running():
            return
        self.world.note(f"{self.name} paused for {seconds:.2f}s")
        self.paused_until = self.world.now + seconds
        self._wake_at = None
        self.world.at(self.paused_until, lambda: self._wake(0.0))

    def crash(self) -> None:
        """SIGKILL: everything in memory is gone; sessions end; Kafka notices after the session timeout."""
        if self.crashed or not self.running:
            return
        self.world.note(f"{self.name} crashed")
        self.crashed = True
        self.table.drop(self.fence)
        self.table.drop(self.purger)
        self.producer.purge()  # what was not transmitted is gone with the process
        self.producer.close()

    def stop(self) -> None:
        """SIGTERM: the core stops marking and sending; once settled (or after a deadline) it leaves the group."""
        if not self.process_running() or self.stopped:
            return
        self.world.note(f"{self.name} stopping")
        self.stopped = True
        self.core.stop()
        self._stop_deadline = self.world.now + self.limits.delivery_timeout + 2 * self.limits.io_error_backoff + 1
        self._wake(0.0)

    # -- the engine loop ------------------------------------------------------------------------

    def _wake(self, delay: float) -> None:
        when = self.world.now + max(0.0, delay)
        if self._wake_at is not None and self._wake_at <= when:
            return
        self._wake_at = when
        self.world.at(when, lambda: self._turn(when))

    def _post(self, action: Callable[[], None]) -> None:
        """A result from another 'thread' (a database session, a delivery report)."""
        if self.crashed:
            return
        self._inbox.append(action)
        self._wake(0.0)

    def _turn(self, scheduled: float) -> None:
        if self._wake_at != scheduled:
            return  # superseded by an earlier wake
        self._wake_at = None
        if not self.process_running():
            return
        if scheduled == self._last_turn:
            self._spins += 1
            if self._spins > 10_000:
                raise Violation(f"{self.name}: the core keeps asking to run again at once (phase "
                                f"{self.core.phase.value}, deadline {self.core.next_deadline()})")
        else:
            self._last_turn, self._spins = scheduled, 0
        core = self.core
        now = self.world.now
        core.tick(now)
        if not self.member.left and now >= self._next_poll:
            self._next_poll = now + self.limits.min_poll_interval
            self._poll_election()
        inbox, self._inbox = self._inbox, []
        for action in inbox:
            action()
        self._execute(core.take_commands())
        if self.stopped and self._stop_deadline is not None and (core.settled or now >= self._stop_deadline):
            if not core.settled:
                core.abort("stopping")
                self._execute(core.take_commands())
            self._leave()
            return
        if self._retiring:
            for old in list(self._retiring):
                if old.outstanding() == 0:
                    self._retiring.remove(old)
                    core.on_producer_restarted()
            self._execute(core.take_commands())
        deadline = core.next_deadline()
        if not self.member.left:
            deadline = min(deadline, self._next_poll)
        self._wake(deadline - now)

    def _poll_election(self) -> None:
        core = self.core
        group = self.group
        if not self.links.leader:
            return  # consume() returns nothing; the coordinator does not hear from us
        while self.member.events:
            event = self.member.events.popleft()
            if event == "assign":
                core.on_assigned()
            elif event == "lost":
                core.on_lost()
                if not self.stopped:
                    group.join(self.member)  # librdkafka rejoins by itself
        core.on_polled()
        heartbeats = group.heartbeats
        seen = any(signature == self._signature for signature, _ in heartbeats[self._heartbeat_offset:]) \
            if group.owner is self.member else False
        self._heartbeat_offset = len(heartbeats)
        if seen:
            core.on_heartbeat_seen()
        if core.assigned:
            signature = self._signature
            # A heartbeat lands a little later, if the link holds.
            self.world.after(self.world.latency(0.001, 0.01),
                             lambda: heartbeats.append((signature, self.world.now)) if self.links.leader else None)

    def _leave(self) -> None:
        """consumer.close(): the revoke callback runs (nothing is left to settle), then the group moves on."""
        self.core.on_revoked()
        self._execute(self.core.take_commands())
        self.group.leave(self.member)
        self.running = False
        self.world.note(f"{self.name} stopped")

    # -- carrying out commands ------------------------------------------------------------------

    def _execute(self, commands: list[cmd.Command]) -> None:
        for command in commands:
            getattr(self, "_do_" + type(command).__name__)(command)

    def _do_Announce(self, command: cmd.Announce) -> None:
        event = command.event
        self.log.events.append((self.world.now, self.name, type(event).__name__))
        if isinstance(event, events.LeaderAcquired | events.LeaderRefreshed):
            self.log.leader_ids.append((self.name, event.leader_id))
        self.world.note(f"{self.name} {event}")

    def _do_Send(self, command: cmd.Send) -> None:
        for record in command.records:
            self.producer.produce(record, self._delivered)

    def _delivered(self, record_id: int, error: DeliveryError | None) -> None:
        self._post(lambda: self.core.on_delivered(record_id, error))

    def _do_AbortSends(self, command: cmd.AbortSends) -> None:
        self.producer.purge()

    def _do_RestartProducer(self, command: cmd.RestartProducer) -> None:
        old = self.producer
        old.purge()
        self._retiring.append(old)
        self.producer = self._new_producer()

    def _new_producer(self) -> SimProducer:
        pipelined = self.limits.max_in_flight_per_key > 1
        return SimProducer(self.kafka, self.name, gapless=pipelined,
                           delivery_timeout=None if pipelined else self.limits.delivery_timeout,
                           is_running=self.process_running, can_reach=lambda: self.links.records)

    # database statements: each session runs one at a time, with a latency

    def _on_session(self, session: Session, run: Callable[[], object], ok: Callable[[object], None],
                    failed: Callable[[str], None]) -> None:
        if session is self.fence:
            start = max(self.world.now, self._fence_busy_until)
        else:
            start = max(self.world.now, self._purge_busy_until)
        faults = self.table.faults
        slow = self.world.now < self.slow_until or self.world.chance(faults.slow)
        finish = start + self.world.latency(*(faults.slow_latency if slow else faults.latency))
        if session is self.fence:
            self._fence_busy_until = finish
        else:
            self._purge_busy_until = finish

        def execute() -> None:
            if self.crashed:
                return
            current = self.fence if session is self.fence else self.purger
            if not current.alive:  # the store reconnects: a new session, holding no lock
                current = Session(self.name, self.group_name)
                if session is self.fence:
                    self.fence = current
                else:
                    self.purger = current
            try:
                if not self.links.database:
                    raise StatementFailed("database unreachable")
                result = run_on(current)
            except StatementFailed as error:
                message = str(error)
                self._post(lambda: failed(message))
                return
            self._post(lambda: ok(result))

        run_on = run  # type: ignore[assignment]
        self.world.at(finish, execute)

    def _do_TakeFence(self, command: cmd.TakeFence) -> None:
        self._on_session(self.fence, lambda s: self.table.take_fence(s),
                         lambda holder: self.core.on_fence(command.leader_id, holder is None, holder),
                         lambda error: self.core.on_fence_failed(command.leader_id, error))

    def _do_ReleaseFence(self, command: cmd.ReleaseFence) -> None:
        self._on_session(self.fence, lambda s: self.table.release_fence(s), lambda _: None, lambda _: None)

    def _do_Mark(self, command: cmd.Mark) -> None:
        self._on_session(self.fence,
                         lambda s: self.table.mark(s, command.leader_id, command.limit, command.after, command.upto),
                         lambda result: self.core.on_marked(command, *result),
                         lambda error: self.core.on_mark_failed(command, error))

    def _do_CheckHeld(self, command: cmd.CheckHeld) -> None:
        self._on_session(self.fence, lambda s: self.table.check_held(s, command.ids),
                         lambda rows: self.core.on_held_checked(command, rows),
                         lambda error: self.core.on_held_check_failed(error))

    def _do_Park(self, command: cmd.Park) -> None:
        self._on_session(self.fence, lambda s: self.table.park(s, command.record),
                         lambda parked: self.core.on_parked(command.record.id, bool(parked)),
                         lambda error: self.core.on_park_failed(command.record.id, error))

    def _do_Purge(self, command: cmd.Purge) -> None:
        fence = self.fence if command.fenced else None
        self._on_session(self.purger, lambda s: self.table.purge(s, command.items, fence),
                         lambda result: self.core.on_purged(result[1]), lambda error: self.core.on_purge_failed(error))

    def _do_Reset(self, command: cmd.Reset) -> None:
        fence = self.fence if command.fenced else None
        self._on_session(self.purger, lambda s: self.table.reset(s, command.items, fence),
                         lambda result: self.core.on_reset(result[1]), lambda error: self.core.on_reset_failed(error))

    def _do_Hold(self, command: cmd.Hold) -> None:
        self._on_session(self.purger, lambda s: self.table.hold(s, command.record_id, command.leader_id),
                         lambda version: self.core.on_held(command.record_id, version),
                         lambda error: self.core.on_held(command.record_id, None))
