"""Kafka transactions in memory: a transactional producer with confluent_kafka.Producer's interface.

What the queue's consumers (Start markers with their offsets) and trackers (a redelivery with its
End marker and their offsets) rely on is modelled:
- a transaction's records take their offsets when produced (a record produced goes out at once
  here) and stay invisible to read_committed consumers until the commit, which adds a control
  record to each partition it wrote; an abort hides them for good;
- send_offsets_to_transaction() checks the group metadata against the group (groups.py): a stale
  generation or a dropped member is refused with an abortable error (KIP-447's fence); the
  offsets are committed to the group with the transaction;
- commit_transaction() may fail (`TransactionFaults`): abortably (nothing committed), or timing
  out with the outcome unknown to the caller, before or after the broker committed. Retrying a
  timed-out commit completes it, as librdkafka's does; aborting one the broker committed fails;
- a transaction left open (its process died in it) holds the last stable offset of every
  partition it wrote until the broker aborts it, after the transaction timeout, or until a new
  producer with the same transactional.id starts transactions: that one fences the old producer
  (whose calls fail fatally from then on) and aborts its open transaction at once;
- a producer can fail for good (`TransactionFaults.fatal`, `stuck`): every later call raises a fatal
  error, and its open transaction stays open on the broker as above;
- the transaction coordinator can be away (`MemoryBroker.coordinator_down_until`, a broker
  restarting): init_transactions() times out, sending offsets and committing fail abortably, and
  an abort fails fatally, as librdkafka's did in a real broker restart ("Producer attempted a
  transactional operation in an invalid state");
- delivery reports are served by poll() and flush(), after the commit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from outbox.kafka.memory.broker import MemoryBroker, StoredMessage
from outbox.kafka.memory.groups import TP, GroupMetadata

STATE = KafkaError(KafkaError._STATE, "Local: Erroneous state")
TRANSPORT = KafkaError(KafkaError._TRANSPORT, "Local: Broker transport failure", txn_requires_abort=True)
INVALID_STATE = KafkaError(KafkaError.INVALID_TXN_STATE, "Broker: Producer attempted a transactional operation in an "
                           "invalid state", fatal=True)
FENCED = KafkaError(KafkaError.PRODUCER_FENCED, "Broker: producer fenced", fatal=True)
#: What outbox.queue.transactional.call_with_deadline raises in place of a send_offsets_to_transaction() that
#: never returns (librdkafka issue 5456): here the call "returns" it at once.
STUCK = KafkaError(KafkaError._TIMED_OUT, "send_offsets_to_transaction() did not return (stuck in librdkafka)",
                   fatal=True)


@dataclass
class TransactionFaults:
    abortable: float = 0.0  # commit fails, nothing committed: abort_transaction() is required
    timeout: float = 0.0  # commit times out before the broker committed (a retry commits)
    timeout_committed: float = 0.0  # the broker committed, the reply was lost (a retry says so)
    fatal: float = 0.0  # a commit fails fatally before the broker committed: the producer is done for
    stuck: float = 0.0  # send_offsets_to_transaction() never returns: the producer is abandoned


@dataclass(eq=False)
class Transaction:
    producer: TransactionalProducer
    began: float
    state: str = "open"  # open, committed, aborted
    messages: list[StoredMessage] = field(default_factory=list)
    reports: list[tuple[Callable[..., None], StoredMessage]] = field(default_factory=list)
    #: group id -> offsets committed with the transaction
    offsets: dict[str, dict[TP, int]] = field(default_factory=dict)


class TransactionalProducer:
    def __init__(self, broker: MemoryBroker, config: dict[str, Any], *, faults: TransactionFaults | None = None,
                 checkpoint: Callable[[], None] = lambda: None) -> None:
        self.broker = broker
        self.world = broker.world
        self.transactional_id = config.get("transactional.id")
        self.random_partitioner = config.get("partitioner") == "random"
        self.timeout = broker.transaction_timeout or float(config.get("transaction.timeout.ms", 60_000)) / 1000
        self.faults = faults or TransactionFaults()
        #: Called at every call into the client: the simulator's crash points.
        self.checkpoint = checkpoint
        self.txn: Transaction | None = None
        self._ready = False
        self._reports: deque[tuple[Callable[..., None], StoredMessage]] = deque()
        self._committing = False  # a commit timed out: the next commit_transaction() completes it
        self._committed_unseen = False  # ... and the broker has committed it already
        #: Why the producer is done for (a fatal error, or fenced by a new one with its transactional.id).
        self.dead: KafkaError | None = None

    # -- confluent-kafka's interface ---------------------------------------------------------------

    def init_transactions(self, timeout: float | None = None) -> None:
        self.checkpoint()
        self._alive()
        if self._coordinator_down():
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "Failed to initialize Producer ID: Local: Timed out",
                                            retriable=True))
        broker = self.broker
        previous = broker.transactional_ids.get(self.transactional_id)
        if previous is not None and previous is not self:
            # A new epoch for the id: the old producer is fenced, and what it left open aborted at once.
            previous.dead = FENCED
            if previous.txn is not None and previous.txn.state == "open":
                previous.broker_end(previous.txn, commit=False)
        broker.transactional_ids[self.transactional_id] = self
        self._ready = True

    def begin_transaction(self) -> None:
        self.checkpoint()
        self._alive()
        if not self._ready or self.txn is not None or self._committing:
            raise KafkaException(STATE)
        txn = Transaction(self, self.world.now)
        self.txn = txn
        self.world.after(self.timeout, lambda: self._expire(txn))

    def produce(self, topic: str, value: Any = None, key: Any = None, partition: int = -1,
                on_delivery: Callable[..., None] | None = None, headers: Any = None, **_: Any) -> None:
        self.checkpoint()
        self._alive()
        txn = self.txn
        if txn is None or txn.state != "open":
            raise KafkaException(STATE)
        partitions = len(self.broker.log(topic))
        if partition < 0:
            partition = self.world.rng.randrange(partitions) if self.random_partitioner \
                else self.broker.partition_of(topic, key)
        message = self.broker.append(topic, partition, key, value, headers, txn=txn)
        self.broker.open_transactions.setdefault((topic, partition), {}).setdefault(txn, message.offset())
        txn.messages.append(message)
        if on_delivery is not None:
            txn.reports.append((on_delivery, message))

    def send_offsets_to_transaction(self, positions: list[Any], group_metadata: GroupMetadata,
                                    timeout: float | None = None) -> None:
        self.checkpoint()
        self._alive()
        txn = self.txn
        if txn is None or txn.state != "open":
            raise KafkaException(STATE)
        if self.world.chance(self.faults.stuck):
            self._die(STUCK)
        if self._coordinator_down():
            raise KafkaException(TRANSPORT)
        group = self.broker.consumer_groups[group_metadata.group]
        refusal = group.refusal(group_metadata.member, group_metadata.generation)
        if refusal is not None:
            raise KafkaException(KafkaError(refusal.code(), refusal.str(), txn_requires_abort=True))
        txn.offsets.setdefault(group_metadata.group, {}).update(
            {(tp.topic, tp.partition): tp.offset for tp in positions})

    def commit_transaction(self, timeout: float | None = None) -> None:
        self.checkpoint()
        self._alive()
        txn = self.txn
        if txn is None:
            if self._committed_unseen:  # the commit that timed out had gone through
                self._committing = self._committed_unseen = False
                return
            raise KafkaException(STATE)
        if txn.state == "aborted":  # the broker aborted it (its timeout): this producer's epoch is over
            raise KafkaException(KafkaError(KafkaError.PRODUCER_FENCED, "Broker: producer fenced", fatal=True))
        if not self._committing:
            world, faults = self.world, self.faults
            if self._coordinator_down():
                raise KafkaException(TRANSPORT)
            if world.chance(faults.fatal):
                self._die(INVALID_STATE)
            if world.chance(faults.abortable):
                raise KafkaException(KafkaError(KafkaError._TRANSPORT, "Local: Broker transport failure",
                                                txn_requires_abort=True))
            if world.chance(faults.timeout):
                self._committing = True
                raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "Local: Timed out", retriable=True))
            if world.chance(faults.timeout_committed):
                self._end(txn, commit=True)
                self._committing = self._committed_unseen = True
                raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "Local: Timed out", retriable=True))
        self._committing = False
        self._end(txn, commit=True)

    def abort_transaction(self, timeout: float | None = None) -> None:
        self.checkpoint()
        self._alive()
        if self._coordinator_down():
            self._die(INVALID_STATE)
        if self._committed_unseen:
            self._committing = self._committed_unseen = False
            raise KafkaException(KafkaError(KafkaError._STATE, "Local: Erroneous state: the transaction committed"))
        self._committing = False
        txn, self.txn = self.txn, None
        if txn is not None and txn.state == "open":
            self.broker_end(txn, commit=False)

    def poll(self, timeout: float = 0) -> int:
        served = 0
        while self._reports:
            callback, message = self._reports.popleft()
            callback(None, message)
            served += 1
        return served

    def flush(self, timeout: float = 0) -> int:
        self.poll()
        return 0

    def __len__(self) -> int:
        return len(self._reports)

    # -- failures ---------------------------------------------------------------------------------

    def _coordinator_down(self) -> bool:
        return self.world.now < self.broker.coordinator_down_until

    def _alive(self) -> None:
        """A producer done for fails every call fatally."""
        if self.dead is not None:
            raise KafkaException(self.dead)

    def _die(self, error: KafkaError) -> None:
        """The producer is done for; its open transaction stays open on the broker (until fenced or expired)."""
        self.dead = error
        raise KafkaException(error)

    # -- the broker's side ------------------------------------------------------------------------

    def _end(self, txn: Transaction, *, commit: bool) -> None:
        self.txn = None
        self.broker_end(txn, commit=commit)
        if commit:
            self._reports.extend(txn.reports)

    def _expire(self, txn: Transaction) -> None:
        if txn.state == "open":
            self.broker_end(txn, commit=False)

    def broker_end(self, txn: Transaction, *, commit: bool) -> None:
        """The coordinator ends the transaction: control records, visibility, the offsets."""
        broker = self.broker
        txn.state = "committed" if commit else "aborted"
        for where in dict.fromkeys((m.topic(), m.partition()) for m in txn.messages):  # in order: no set of str
            opened = broker.open_transactions.get(where)
            if opened is not None:
                opened.pop(txn, None)
                if not opened:
                    del broker.open_transactions[where]
            broker.append(where[0], where[1], None, None, None, control=True)
        if not commit:
            return
        for group, offsets in txn.offsets.items():
            broker.consumer_groups[group].commit(offsets, notify=False)
        for watcher in broker.watchers:
            watcher.transaction(txn.messages, txn.offsets)
