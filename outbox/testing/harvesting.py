"""A harvest for tests: the real engine (its core and driver, its SQL) run on the calling thread until the outbox
is empty, publishing to an in-memory Kafka, and what it published returned. No broker, no thread, no sleep.

    from outbox.testing import harvest

    def test_paying_publishes(db):
        pay(42)                                    # stash()es in its transaction
        [message] = harvest()
        assert (message.topic, message.key, message.json()) == ("orders", "42", {"status": "paid"})

The engine's statements run on the test's own database connection, so it sees what a `TestCase` (or
pytest-django's `db`) test stashed, though that transaction never commits; under `transactional_db` the
same connection reads committed rows. Purged rows are gone from the outbox afterwards, as after a real
harvest. What stands in for the rest of the world: time is the engine's own clock, advanced from one of
its deadlines to the next (a harvest of a thousand records takes milliseconds); this process leads at once
(the leader election, with no other replica, has nothing to decide); and the in-memory Kafka
(outbox/kafka/memory/) acknowledges every record, a moment later.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import methodcaller
from typing import Any

from psycopg import sql

from outbox.harvest import events
from outbox.harvest.config import Limits
from outbox.harvest.connector import Store
from outbox.harvest.contract import Record
from outbox.harvest.core import Core
from outbox.harvest.driver import Driver
from outbox.harvest.store import PostgresStore
from outbox.kafka.memory.broker import MemoryBroker, MemoryProducer
from outbox.kafka.memory.world import SimWorld
from outbox.kafka.sizes import UNLIMITED

#: The engine's clock runs at most this far (seconds of its own time) before the harvest gives up.
GIVE_UP_AFTER = 600.0


@dataclass(frozen=True)
class Published:
    """One message the harvest published, as a consumer of the topic would read it."""

    topic: str
    key: str | None
    #: The value as published (None for a tombstone).
    value: str | None
    headers: list[tuple[str, str]] = field(default_factory=list)
    partition: int = 0
    offset: int = 0

    def json(self) -> Any:
        """The value decoded as JSON."""
        return None if self.value is None else json.loads(self.value)

    def header(self, name: str) -> str | None:
        """The last header of that name (outbox-id, outbox-create-time and the record's own), if any."""
        found = [value for key, value in self.headers if key == name]
        return found[-1] if found else None

    @property
    def outbox_id(self) -> int:
        return int(self.header("outbox-id") or 0)


class TestSessionStore(PostgresStore):
    """The engine's store on one session it is given (the test's own connection) for both its fence and purge
    statements, which it never closes: what the test's transaction holds, the engine sees."""

    __test__ = False  # not a pytest test class

    def __init__(self, conn: Any, table: str, table_oid: int) -> None:
        super().__init__("", table, name="outbox.testing", table_oid=table_oid, counts_failures=True)
        self._session = self._fence_conn = self._purge_conn = conn

    def _fence_connection(self) -> Any:
        return self._session

    def _purge_connection(self) -> Any:
        return self._session

    def _drop_fence(self) -> None:
        self._fence_held = False
        self.fence_pid = 0

    def _drop_purge(self) -> None:
        pass

    def close(self) -> None:
        self.release_fence()


class InlineIO:
    """The driver's EngineIO on the calling thread: each database job runs at once, in order, on the store; the
    record producer is the in-memory Kafka's, whose reports come as the engine's clock passes them."""

    def __init__(self, world: SimWorld, broker: MemoryBroker, store: Store, post: Callable[[Any], None]) -> None:
        self._world, self._broker, self._store, self._post = world, broker, store, post
        self.producer = MemoryProducer(broker, "outbox.testing")
        self.batch_limit = UNLIMITED
        self.assigned = False

    def now(self) -> float:
        return self._world.now

    def topic_limit_stale(self, topic: str) -> bool:
        return False

    def topic_limit(self, topic: str) -> int | None:
        return UNLIMITED

    def fit_batches(self, limit: int) -> bool:
        return True

    def refused_for_size(self, topic: str | None) -> None:
        return None

    def submit(self, session: str, job: Callable[[Store], None]) -> None:
        job(self._store)

    def restart_producer(self) -> None:
        self.producer.purge()
        self.producer = MemoryProducer(self._broker, "outbox.testing")
        self._post(methodcaller("on_producer_restarted"))

    def publish_dead_letter(self, record: Record, reason: str) -> str | None:
        return None

    def release_partition(self) -> None:
        return None

    def leadership(self, *, assigned: bool, leading: bool) -> None:
        self.assigned = assigned

    def announce(self, event: events.Event) -> None:
        return None


def harvest(*, using: str | None = None, limits: Limits | None = None) -> list[Published]:
    """Publish every record in the outbox with the real engine, on this thread, to an in-memory Kafka; returns the
    messages published, in the order they were written to each partition (a key's in id order). Raises
    AssertionError if the outbox is not empty at the end (a record held as poison stays: the message says
    which)."""
    from django.db import connections

    from outbox import conf
    from outbox.models import OutboxRecord

    alias = using or conf.database_alias()
    connection = connections[alias]
    connection.ensure_connection()
    session = connection.connection
    table = OutboxRecord._meta.db_table
    table_oid = session.execute("SELECT %s::regclass::oid", [table]).fetchone()[0]
    store = TestSessionStore(session, table, int(table_oid))
    world = SimWorld(0)
    broker = MemoryBroker(world, partitions=1)
    core = Core(limits or Limits(), now=world.now)
    driver: Driver | None = None
    io = InlineIO(world, broker, store, lambda result: driver.post(result) if driver is not None else None)
    driver = Driver(core, io, parked_by="outbox.testing")
    driver.post(methodcaller("on_assigned"))
    left = -1
    try:
        while world.now < GIVE_UP_AFTER:
            driver.post(lambda core: core.on_polled(True))  # its own heartbeat, seen: it leads
            driver.post(methodcaller("on_notified"))
            deadline = driver.turn()
            if core.leading and not core.in_flight and not core.queued:
                left = _rows_left(session, table)
                if left <= len(core.snapshot().held):  # done: what is left fails on its own (poison)
                    break
            world.run_until(max(world.now + 0.001, min(deadline, world.now + 0.05)))
    finally:
        store.close()
    if left:
        held = {record.id: record.reason for record in core.snapshot().held}
        raise AssertionError(f"the harvest left {max(left, 0) or 'some'} record(s) in the outbox"
                             + (f"; held (they fail on their own): {held}" if held else ""))
    return [_published(message) for topic in sorted(broker.topics) for message in broker.messages(topic)]


def _rows_left(session: Any, table: str) -> int:
    query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))
    return int(session.execute(query).fetchone()[0])


def _published(message: Any) -> Published:
    headers = [(key, value.decode() if isinstance(value, bytes) else value) for key, value in message.headers() or []]
    value = message.value()
    return Published(message.topic(), _text(message.key()), _text(value), headers, message.partition(),
                     message.offset())


def _text(data: Any) -> str | None:
    return data.decode() if isinstance(data, bytes) else data
