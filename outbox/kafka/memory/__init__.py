"""One in-memory Kafka, behind confluent-kafka's interfaces (the outbox table's twin is the engine's own,
outbox/harvest/memory_table.py).

The deterministic simulator (tests/sim/) runs it on a seeded clock with faults; the fakes users
get for their tests (outbox.harvest.fakes) run it in real time with the faults off. Either way the
engine meets the same `Store` (connector.py) and the same confluent-kafka producer and consumer
interfaces as in production.

- world.py: time, scheduled actions and chance (SimWorld: seeded; LiveWorld: the wall clock);
- broker.py: topics and idempotent producers;
- groups.py and consumer.py: the one model of a consumer group (assignment, cooperative rebalances,
  generations, committed offsets; the leader elections' groups and the queues' alike) and a consumer
  in one, with confluent-kafka's interface;
- transactions.py: a transactional producer (read_committed visibility, the group's fence);
- share_groups.py and share_consumer.py: Kafka's share groups, for the queues' share backend.
"""
