"""One in-memory world of the outbox table and of Kafka, behind the engine's own interfaces.

The deterministic simulator (tests/sim/) runs it on a seeded clock with faults; the fakes users
get for their tests (outbox.harvest.fakes) run it in real time with the faults off. Either way the
engine meets the same `Store` (connector.py) and the same confluent-kafka producer and consumer
interfaces as in production.

- world.py: time, scheduled actions and chance (SimWorld: seeded; LiveWorld: the wall clock);
- table.py: the outbox table, its sessions and fence, and MemoryStore (the Store protocol);
- broker.py: topics, idempotent producers, the leader election's consumer group;
- groups.py and consumer.py: consumer groups over whole topics (assignment, rebalances,
  generations, committed offsets) and a consumer in one, with confluent-kafka's interface;
- transactions.py: a transactional producer (read_committed visibility, the group's fence).
The queue's simulator runs its consumers and trackers on the last three.
"""
