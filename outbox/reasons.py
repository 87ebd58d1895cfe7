"""One line for the operator from any error: what the harvester, the queue and the pipeline say when
something fails. Django-free, so the engine and the pipeline can use it."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException


def first_line(error: BaseException | str) -> str:
    """The first line of an error's text (psycopg's and Java's run to several), or its type's name."""
    text = (error if isinstance(error, str) else str(error)).strip()
    if text:
        return text.splitlines()[0]
    return "no reason given" if isinstance(error, str) else type(error).__name__


def kafka_error(error: BaseException) -> KafkaError | None:
    """The KafkaError a KafkaException carries, if it carries one."""
    args = getattr(error, "args", ())
    return args[0] if args and isinstance(args[0], KafkaError) else None


def kafka_reason(error: BaseException) -> str:
    """Kafka's own words when the error carries a KafkaError, else the error's first line."""
    found = kafka_error(error) if isinstance(error, KafkaException) else None
    return found.str() if found is not None else first_line(error)


def kafka_code(error: BaseException) -> int | None:
    """The KafkaError code an error carries, if any."""
    found = kafka_error(error)
    return None if found is None else found.code()
