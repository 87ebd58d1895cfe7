"""The headers the outbox adds to the messages it publishes: names other tools rely on (the harvester writes
them, the audit and the in-memory Kafka read them)."""

#: Headers the harvester adds to every message, beside the record's own.
HEADER_ID = "outbox-id"
HEADER_CREATE_TIME = "outbox-create-time"
#: Added to a record published to the dead-letter topic: why it was parked, and its own topic.
HEADER_DEAD_LETTER_REASON = "outbox-dead-letter-reason"
HEADER_TOPIC = "outbox-topic"
RESERVED_HEADERS = frozenset({HEADER_ID, HEADER_CREATE_TIME})
