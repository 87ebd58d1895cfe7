"""What the harvester and the queues share about Kafka (clients, sizes, headers, names, redaction, riding through
an outage) and the one in-memory Kafka; it imports nothing from either (docs/architecture.md)."""
