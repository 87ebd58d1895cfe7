"""The invariants checked after every simulated run (two more are checked as the table runs)."""

from __future__ import annotations

from collections import defaultdict

from outbox.harvest.memory_table import MemoryTable
from outbox.kafka.memory.broker import MemoryBroker
from outbox.kafka.memory.world import Violation
from tests.sim.replica import Log

#: The topic every simulated record goes to.
TOPIC = "orders"


def per_key(kafka: MemoryBroker) -> dict[str, list[int]]:
    """Each key's record ids in the order Kafka holds them (a key lives in one partition)."""
    sequences: dict[str, list[int]] = defaultdict(list)
    for message in kafka.messages(TOPIC):
        sequences[message.key_text].append(message.record_id)
    return sequences


def check_order(kafka: MemoryBroker, *, strict: bool) -> None:
    """No record is published after a later record of its key, except as a repeat of one already
    published. `strict` (one record per key in flight) also forbids any repeat that is not one-off:
    the published ids never go down (R0 R1 R1 R2 is fine, R0 R1 R2 R1 is not)."""
    for key, ids in per_key(kafka).items():
        seen: set[int] = set()
        highest = 0
        for position, record_id in enumerate(ids):
            if record_id < highest and (strict or record_id not in seen):
                kind = "went back" if strict else "was first published"
                raise Violation(f"key {key}: record {record_id} {kind} after record {highest} "
                                f"(position {position} of {ids[max(0, position - 6):position + 2]})")
            seen.add(record_id)
            highest = max(highest, record_id)


def check_leader_ids(log: Log) -> None:
    ids = [leader_id for _, leader_id in log.leader_ids]
    if len(ids) != len(set(ids)):
        repeated = next(i for i in ids if ids.count(i) > 1)
        raise Violation(f"leader id {repeated} was used for more than one term")


def check_drained(table: MemoryTable) -> None:
    pending = table.pending()
    if pending:
        rows = ", ".join(f"{r.id} (key {r.key}, leader {str(r.leader_id)[:8] if r.leader_id else None})"
                         for r in pending[:5])
        raise Violation(f"{len(pending)} record(s) never published after faults stopped, e.g. {rows}")


def check_nothing_lost(kafka: MemoryBroker, table: MemoryTable) -> None:
    """Every committed row is in Kafka, or still in the table, or was removed by an operator or parked."""
    for row_id in table.committed:
        if (row_id not in kafka.published and row_id not in table.rows and row_id not in table.removed_by_operator
                and row_id not in table.parked):
            raise Violation(f"record {row_id} is neither in Kafka nor in the table")


def check_batches_fit(kafka: MemoryBroker, steady_from: float) -> None:
    """With a topic limit known to the replicas, no batch goes out that the topic refuses for its size:
    such a refusal fails every key's records in the batch (and a gapless producer as a whole)."""
    late = [(at, topic) for at, topic in kafka.size_refusals if at >= steady_from]
    if late:
        at, topic = late[0]
        raise Violation(f"{len(late)} batch(es) refused for their size by topic {topic}, the first at t={at:.3f}")
