"""What the harvester and the queues share about Kafka: how a process rides through an outage."""
