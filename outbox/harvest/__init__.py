"""The harvest engine: leader election over Kafka and the mark/purge/reset pipeline.

Imports the standard library, psycopg and confluent-kafka only, never Django,
so it can be embedded anywhere; `outbox.conf` adapts Django settings to it.
"""
