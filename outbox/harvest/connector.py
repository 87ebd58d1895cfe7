"""Everything outside the process, behind one object the Harvester is given.

`LiveConnector` builds the real clients (psycopg, confluent-kafka) from the configuration;
`outbox.harvest.fakes.FakeConnector` builds in-memory ones, so tests (yours too) run the real
engine with no broker and no database. A test that needs a fault wraps one method of either.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from confluent_kafka import Consumer, Producer

from outbox.harvest.config import HarvestConfig, assumed_schema, derived_leader_name
from outbox.harvest.contract import Record
from outbox.harvest.kafka import (
    ProducerLike,
    dead_letter_producer_config,
    ensure_leader_topic,
    heartbeat_producer_config,
    leader_consumer_config,
    record_producer_config,
)
from outbox.harvest.neli import LeaderElection
from outbox.harvest.notify_hub import ChannelListener, NotifyHubs
from outbox.harvest.status import StatusSnapshot
from outbox.harvest.status_board import BoardReporter, StatusBoards
from outbox.harvest.store import FenceHolder, PostgresStore
from outbox.harvest.topics import TopicLimits
from outbox.kafka.clients import admin_describe

log = logging.getLogger("outbox.harvest")


#: (leader group, table) already warned of: each of a sharded replica's engines opens a store.
_warned: set[tuple[str, str]] = set()


def warn_of_a_derived_group_of_another_schema(config: HarvestConfig, schema: str) -> None:
    """An unqualified table found in another schema than its derived leader group assumes (a search_path set by
    the role, the database or PGOPTIONS, which the settings do not show): an `outbox` table of another schema of
    the same database, harvested the same way, would get the same group, and only one of the two would be
    harvested. Said once, at WARNING, with what to set."""
    if "." in config.table or (config.leader_group, config.table) in _warned:
        return
    assumed = assumed_schema(config.dsn)
    if schema != assumed and config.leader_group == derived_leader_name(config.dsn, config.table):
        _warned.add((config.leader_group, config.table))
        qualified = f"{schema}.{config.table}"
        log.warning("Table %r is %s here (the session's search_path), but its leader group %s was derived as if it "
                    "were in schema %s: an outbox table of another schema of this database could get the same group, "
                    "and only one of the two would be harvested; set table = %r (or leader_topic and leader_group)",
                    config.table, qualified, config.leader_group, assumed, qualified)


class Store(Protocol):
    """What the engine needs from the database (store.PostgresStore is the real one)."""

    table_oid: int
    partitioned: bool

    def take_fence(self, *, end_stale: bool = True) -> FenceHolder | None: ...
    def release_fence(self, *, settled: bool = True) -> None: ...
    def mark(self, limit: int, after: int,
             gaps: Sequence[tuple[int, int]] = ()) -> tuple[list[Record], frozenset[str] | None]: ...
    def check_held(self, ids: Sequence[int]) -> dict[int, Record]: ...
    def park(self, record: Record, reason: str, attempts: int, parked_by: str,
             dead_letter_topic: str | None) -> bool: ...
    def purge(self, ids: Sequence[int], read_fence: bool = True, durable: bool = True) -> tuple[int, bool]: ...
    def reset(self, ids: Sequence[int], errors: Sequence[str]) -> tuple[int, bool]: ...
    def hold(self, record_id: int, reason: str) -> int | None: ...
    def has_notify_trigger(self) -> bool: ...
    def close(self) -> None: ...


class ListenerLike(Protocol):
    """What wakes a leader when its table is written (notify_hub.ChannelListener)."""

    def fileno(self) -> int | None: ...
    def drain(self) -> int: ...
    def close(self) -> None: ...
    @property
    def connected(self) -> bool: ...


class Connector(Protocol):
    """Builds the harvester's outside systems; every method may raise StoreError or KafkaUnavailable."""

    #: The record producer's batches fit this many bytes (None: librdkafka's batch.size); the runtime sets it
    #: before building each record producer (producers.py): None until a topic's max.message.bytes lowers it.
    batch_limit: int | None

    def open_store(self) -> Store: ...
    def ensure_leader_topic(self) -> None: ...
    def topic_limits(self) -> TopicLimits: ...
    def record_producer(self) -> ProducerLike: ...
    def dead_letter_producer(self) -> ProducerLike: ...
    def leader_election(self) -> LeaderElection: ...
    def listener(self, channel: str) -> ListenerLike | None: ...
    def status_reporter(self, snapshot: Callable[[], StatusSnapshot],
                        on_backlog: Callable[[int], None]) -> BoardReporter | None: ...


class LiveConnector:
    """The real thing: Postgres through psycopg 3, Kafka through confluent-kafka."""

    #: The store it opens (outboxes.RestingStore: one that closes its fence session while standing by).
    store_class: type[PostgresStore] = PostgresStore

    def __init__(self, config: HarvestConfig, hubs: NotifyHubs | None = None,
                 boards: StatusBoards | None = None) -> None:
        """`hubs`, `boards`: the process's LISTEN hubs and status writers, shared by all its engines (default: this
        engine's own)."""
        self.config = config
        self.hubs = hubs if hubs is not None else NotifyHubs(name=config.name)
        self.boards = boards if boards is not None else StatusBoards(name=config.name)
        self.batch_limit: int | None = None

    def topic_limits(self) -> TopicLimits:
        return TopicLimits(admin_describe(dict(self.config.base_kafka_config)),
                           refresh_interval=self.config.limits.topic_limits_interval)

    def open_store(self) -> PostgresStore:
        config = self.config
        store = self.store_class.open(config.dsn, config.table, name=config.name, group=config.leader_group,
                                      dead_letter_table=config.dead_letter_table, status_table=config.status_table,
                                      shards=config.shards, shard=config.shard)
        warn_of_a_derived_group_of_another_schema(config, store.schema)
        return store

    def ensure_leader_topic(self) -> None:
        ensure_leader_topic(self.config)

    def record_producer(self) -> Producer:
        return Producer(record_producer_config(self.config, self.batch_limit))

    def dead_letter_producer(self) -> Producer:
        return Producer(dead_letter_producer_config(self.config))

    def leader_election(self) -> LeaderElection:
        config = self.config
        return LeaderElection(config.leader_topic, config.name, Consumer(leader_consumer_config(config)),
                              Producer(heartbeat_producer_config(config)), max_age=config.limits.heartbeat_timeout)

    def listener(self, channel: str) -> ChannelListener:
        return self.hubs.subscribe(self.config.dsn, channel)

    def status_reporter(self, snapshot: Callable[[], StatusSnapshot], on_backlog: Callable[[int], None], *,
                        sharded_replica: bool = False) -> BoardReporter | None:
        return self.boards.reporter(self.config, snapshot, on_backlog, sharded_replica=sharded_replica)
