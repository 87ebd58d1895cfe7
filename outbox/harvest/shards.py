"""A sharded replica: one group consumer of the leader topic, and an engine for each shard it is given.

    harvester = ShardedHarvester(config)      # config.shards > 1
    harvester.start(); ...; harvester.stop(); harvester.wait()

Kafka's group protocol decides who leads what: the leader topic has a partition per shard, the replicas of a group
consume it with cooperative-sticky assignment, and partition s assigned to a replica makes it shard s's leader; a
rebalance moves only the partitions that change owner. Each shard has an engine of its own (a `Harvester` over the
shard's rows, sharding.py) whose election is a `ShardElection`: a view of the replica's one group consumer
(`ShardGroup`), which routes each engine's heartbeats back to it and queues its shard's rebalance events for the
engine's next poll, as librdkafka runs callbacks inside poll(). Fast NELI holds per shard.

Hand-off: Kafka hands a revoked partition on at once, and the database fence orders the hand-off (leadership.py).
The manager (supervisor.py, with `retires` below) starts an engine when a shard is assigned and stops it once its
shard was revoked and it settled.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import Consumer, KafkaException, Producer

from outbox.harvest import events, sharding
from outbox.harvest.config import HarvestConfig
from outbox.harvest.connector import LiveConnector
from outbox.harvest.contract import ReplicaState
from outbox.harvest.harvester import Harvester, HarvestError, State, check_config, start_failure
from outbox.harvest.instruments import Instruments
from outbox.harvest.kafka import (
    ConsumerLike,
    ProducerLike,
    ensure_leader_topic,
    heartbeat_producer_config,
    leader_consumer_config,
)
from outbox.harvest.neli import leader_topic_error, publish_heartbeat
from outbox.harvest.notify_hub import NotifyHubs
from outbox.harvest.shard_index import prepare_table
from outbox.harvest.status import StatusSnapshot
from outbox.harvest.status_board import BoardReporter, StatusBoards
from outbox.harvest.store import StoreError
from outbox.harvest.supervisor import ENDING, EngineSet, Supervisor
from outbox.harvest.tracing import PublishTracer
from outbox.kafka.clients import KafkaUnavailable
from outbox.kafka.redaction import remember_secrets

log = logging.getLogger("outbox.harvest.shards")

#: Seconds between two steps of the manager.
MANAGE_INTERVAL = 0.05


class ShardElection:
    """One shard's leader election: LeaderElection's interface over the replica's group consumer (ShardGroup)."""

    def __init__(self, group: ShardGroup, shard: int, name: str) -> None:
        self.group = group
        self.shard = shard
        self.signature = f"%{name}%{uuid.uuid4().hex}".encode()
        self._lock = threading.Lock()
        self._events: deque[str] = deque()
        self._seen = False
        self._callbacks: dict[str, Callable[[], None]] = {}
        self.was_assigned = False
        #: Its revoke (settled) or loss was taken in by the engine: the engine may be stopped.
        self.gone = False

    def start(self, on_assigned: Callable[[], None], on_revoked: Callable[[], None],
              on_lost: Callable[[], None]) -> None:
        self._callbacks = {"assign": on_assigned, "revoke": on_revoked, "lost": on_lost}
        self.group.attach(self)

    def notify(self, event: str) -> None:
        """From the group thread: the shard was assigned, revoked or lost."""
        with self._lock:
            self._events.append(event)

    def heard(self) -> None:
        """From the group thread: one of this engine's heartbeats came back."""
        with self._lock:
            self._seen = True

    def poll(self, *, heartbeat: bool) -> bool:
        """Serve the rebalance events since the last poll (a revoke returns once the engine settled), and publish
        the next heartbeat if asked; True if an own heartbeat came back."""
        with self._lock:
            pending, self._events = list(self._events), deque()
            seen, self._seen = self._seen, False
        for index, event in enumerate(pending):
            if self.gone:
                break
            try:
                self._serve(event)
            except BaseException:  # its event, and those after it, are the next poll's (as librdkafka's are)
                with self._lock:
                    self._events.extendleft(reversed(pending[index:]))
                    self._seen = self._seen or seen
                raise
        if heartbeat and not self.gone:
            self.group.heartbeat(self.shard, self.signature)
        return seen and not self.gone

    def _serve(self, event: str) -> None:
        self.was_assigned = self.was_assigned or event == "assign"
        self._callbacks[event]()  # a revoke returns once the engine released the shard (ElectionThread._hold)
        if event != "assign":
            self.gone = True

    def close(self) -> None:
        self.group.detach(self)


class ShardGroup(threading.Thread):
    """The replica's one consumer of the leader topic (the group protocol assigns shards) and heartbeat producer."""

    def __init__(self, config: HarvestConfig, consumer: ConsumerLike, producer: ProducerLike,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(name="outbox-shards-group", daemon=True)
        self.topic = config.leader_topic
        #: Heartbeats carry when they were sent: one older than heartbeat_timeout counts for nothing (neli.py's why).
        self._clock = clock
        self._max_age = config.limits.heartbeat_timeout
        self._interval = config.limits.min_poll_interval
        self._consumer = consumer
        self._producer = producer
        self._lock = threading.Lock()
        self._assigned: set[int] = set()
        self._views: dict[int, ShardElection] = {}
        self._stop_event = threading.Event()
        self.failure: BaseException | None = None

    def owned(self) -> set[int]:
        with self._lock:
            return set(self._assigned)

    def attach(self, view: ShardElection) -> None:
        with self._lock:
            self._views[view.shard] = view
            if view.shard in self._assigned:
                view.notify("assign")

    def detach(self, view: ShardElection) -> None:
        with self._lock:
            if self._views.get(view.shard) is view:
                del self._views[view.shard]

    def heartbeat(self, shard: int, signature: bytes) -> None:
        publish_heartbeat(self._producer, self.topic, shard, repr(self._clock()).encode() + signature)

    def stop(self) -> None:
        self._stop_event.set()

    def close(self) -> None:
        """Close the consumer: one that joined leaves the group, so its shards move at once."""
        try:
            self._consumer.close()
        except (KafkaException, RuntimeError) as error:
            log.warning("Closing the leader consumer: %s", error)

    def route(self, partition: int, value: bytes) -> None:
        """A message of the leader topic: tell an engine its own heartbeat, sent within heartbeat_timeout."""
        with self._lock:
            view = self._views.get(partition)
        if view is None or not value.endswith(view.signature):
            return
        try:
            sent = float(value[:-len(view.signature)])
        except ValueError:
            return
        if self._clock() - sent <= self._max_age:
            view.heard()

    def _changed(self, event: str, partitions: list[Any]) -> None:
        shards = sorted(p.partition for p in partitions)
        if not shards:
            return
        log.info("Shard%s %s %s", "s" if len(shards) > 1 else "", ", ".join(map(str, shards)),
                 {"assign": "assigned", "revoke": "revoked", "lost": "lost"}[event])
        with self._lock:
            for shard in shards:
                (self._assigned.add if event == "assign" else self._assigned.discard)(shard)
                view = self._views.get(shard)
                if view is not None:
                    view.notify(event)

    @property
    def stopping(self) -> bool:
        return self._stop_event.is_set()

    def subscribe(self) -> None:
        """Join the group: its assignments, revokes and losses reach the engines' views."""
        self._consumer.subscribe([self.topic], on_assign=lambda _c, ps: self._changed("assign", ps),
                                 on_revoke=lambda _c, ps: self._changed("revoke", ps),
                                 on_lost=lambda _c, ps: self._changed("lost", ps))

    def step(self) -> None:
        """One poll of the leader topic (the group's callbacks, heartbeats routed), then the heartbeat producer's
        callbacks. Raises KafkaUnavailable on a fatal consumer error."""
        for message in self._consumer.consume(num_messages=512, timeout=self._interval):
            error = message.error()
            if error is not None:
                leader_topic_error(error)
                continue
            self.route(message.partition(), message.value() or b"")
        self._producer.poll(0)

    def end(self) -> None:
        self.close()
        self._producer.flush(1.0)

    def run(self) -> None:
        try:
            self.subscribe()
            while not self._stop_event.is_set():
                self.step()
        except BaseException as error:  # the harvester notices and stops as a whole
            self.failure = error
            log.error("Leader election failed: %s", error)
        finally:
            self.end()


def retires(shard: int, owned: set[int], election: ShardElection | None) -> bool:
    """Whether a running shard's engine must stop (it settles first): its revoke or loss was taken in (a shard
    revoked and assigned again gets a fresh engine), or its shard is no longer this replica's and it never took the
    assignment in."""
    if election is None:
        return shard not in owned
    return election.gone or (shard not in owned and not election.was_assigned)


class ShardConnector(LiveConnector):
    """The live connector of one shard's engine: its election is a view of the replica's group."""

    def __init__(self, config: HarvestConfig, group: ShardGroup, hubs: NotifyHubs, boards: StatusBoards) -> None:
        super().__init__(config, hubs, boards)
        self._group = group
        self.election: ShardElection | None = None

    def ensure_leader_topic(self) -> None:
        pass  # the sharded harvester did, with one partition per shard

    def leader_election(self) -> ShardElection:  # type: ignore[override]
        self.election = ShardElection(self._group, self.config.shard, self.config.name)
        return self.election


class ShardedHarvester(EngineSet[int, Harvester]):
    """Harvests one outbox table in `config.shards` shards; any number of replicas may run, each shard is
    led by one of them (module docstring)."""

    manage_interval = MANAGE_INTERVAL
    thread_name = "outbox-shards"
    kind = "Sharded harvester"

    def __init__(self, config: HarvestConfig, *, on_event: Callable[[Harvester, events.Event], None] | None = None,
                 instruments: Callable[[int], Instruments] | None = None, tracer: PublishTracer | None = None,
                 consumer_factory: Callable[[dict[str, Any]], ConsumerLike] = Consumer,
                 producer_factory: Callable[[dict[str, Any]], ProducerLike] = Producer,
                 hubs: NotifyHubs | None = None, boards: StatusBoards | None = None,
                 supervisor_class: type[Supervisor[int, Harvester]] = Supervisor,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`hubs`, `boards`: the process's (ManyHarvester's, where this is one of its outboxes; default: its own);
        `supervisor_class`, `clock`: the simulator's."""
        super().__init__(self._start_engine, describe=lambda shard: f"Shard {shard}'s engine", name=config.name,
                         hubs=hubs, boards=boards, supervisor_class=supervisor_class, clock=clock)
        self.config = config
        remember_secrets(config.dsn, config.base_kafka_config, config.producer_kafka_config)
        self._on_event = on_event
        self._instruments = instruments
        self._tracer = tracer
        self._consumer_factory, self._producer_factory = consumer_factory, producer_factory
        self._connectors: dict[int, ShardConnector] = {}
        self._group: ShardGroup | None = None
        self._owned: set[int] = set()
        self._status: BoardReporter | None = None
        self._started_at = datetime.now(UTC)

    leading_shards = EngineSet.leading  # the shards it publishes now (assigned, own heartbeats seen, fence held)

    def _leads(self, engine: Harvester) -> bool:
        return engine.is_leader

    def _replica_status(self) -> StatusSnapshot:
        """The replica's own row: in the group (its engines' rows say which shards it leads), with its totals."""
        engines = list(self.engines.values())
        state = ENDING.get(self._state, ReplicaState.STANDBY)
        meters = [engine.last_meter for engine in engines if engine.last_meter is not None]
        return StatusSnapshot(state=state, leader_id=None, since=self._started_at, in_flight=0, queued=0,
                              in_flight_keys=[], in_flight_key_count=0, held=[], blocked_by=None,
                              throughput=sum(meter.rate for meter in meters),
                              published=sum(engine.published for engine in engines),
                              failed=sum(engine.failed for engine in engines))

    def open(self) -> bool:
        """Check the config, the table and the leader topic, and join the group (or HarvestError); False if stop()
        came meanwhile."""
        config = self.config
        check_config(config)
        if config.shards < 2:
            raise HarvestError("a sharded harvester needs shards > 1 (Harvester harvests one shard)")
        group = self._join_group()
        with self._state_lock:
            if self._state is not State.CREATED:  # stop() came meanwhile: the consumer never joined
                group.close()
                return False
            self._state = State.RUNNING
        self._group = group
        group.start()
        self._status = self.boards.reporter(config, self._replica_status, lambda _rows: None, sharded_replica=True)
        if self._status is not None:
            self._status.start()
        log.info("Harvesting %s in %d shards as %s (leader topic %s, group %s)", config.table, config.shards,
                 config.name, config.leader_topic, config.leader_group)
        return True

    def _join_group(self) -> ShardGroup:
        """The table's shard terms, the leader topic with a partition per shard, the table's shard index (in that
        order: shard_index.prepare_table), the group's consumer and producer."""
        config = self.config
        try:
            prepare_table(config, lambda: ensure_leader_topic(config))
            consumer = self._consumer_factory(leader_consumer_config(config))
            producer = self._producer_factory(heartbeat_producer_config(config))
        except (StoreError, KafkaUnavailable, KafkaException) as error:
            raise start_failure(error) from None
        return ShardGroup(config, consumer, producer)

    def wanted(self, now: float) -> set[int]:
        assert self._group is not None
        if self._group.failure is not None:
            raise self._group.failure
        self._owned = self._group.owned()  # one look per step: retires() reads the same
        return self._owned

    def retires(self, shard: int, engine: Harvester) -> bool:
        return retires(shard, self._owned, self._election(shard, engine))

    def _closed(self) -> None:
        group = self._group
        if group is not None:
            group.stop()
            group.join(timeout=10)
        if self._status is not None:
            self._status.close()

    def _start_engine(self, shard: int) -> Harvester:
        engine = self._new_engine(shard)
        engine.start()
        return engine

    def _new_engine(self, shard: int) -> Harvester:
        """Shard `shard`'s engine, not started, named after it."""
        assert self._group is not None
        config = self._engine_config(shard)
        connector = self._connectors[shard] = ShardConnector(config, self._group, self.hubs, self.boards)
        return Harvester.sending_events_to(
            self._on_event, config, connector=connector, tracer=self._tracer,
            instruments=self._instruments(shard) if self._instruments is not None else None)

    def _engine_config(self, shard: int) -> HarvestConfig:
        return dataclasses.replace(self.config.for_shard(shard), name=sharding.engine_name(self.config.name, shard))

    def _election(self, shard: int, engine: Harvester) -> ShardElection | None:
        """The engine's view of its shard (None until it asked for one)."""
        connector = self._connectors.get(shard)
        return connector.election if connector is not None else None
