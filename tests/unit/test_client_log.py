"""librdkafka's own log lines, as the outbox's clients hand them to Python logging (outbox.kafka.clients)."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka import KafkaError

from outbox.kafka.clients import client_log

GETPID = ("[thrd:main]: Failed to acquire idempotence PID from broker 127.0.0.1:9092/1: Broker: Coordinator load in "
          "progress: retrying")


def lines(caplog: pytest.LogCaptureFixture, level: int, fac: str, text: str) -> list[tuple[str, str]]:
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=client_log.name):
        client_log.log(level, "%s [%s] %s", "rdkafka#producer-1", fac, text)
    return [(record.levelname, record.getMessage()) for record in caplog.records]


def test_a_coordinator_still_loading_is_said_at_info_and_other_warnings_stay_warnings(caplog):
    assert lines(caplog, logging.WARNING, "GETPID", GETPID) == [("INFO", f"rdkafka#producer-1 [GETPID] {GETPID}")]
    refused = GETPID.replace("Coordinator load in progress", "Cluster authorization failed")
    assert lines(caplog, logging.WARNING, "GETPID", refused)[0][0] == "WARNING"


def test_a_warning_said_at_info_is_not_heard_where_info_is_off():
    """`harvest -v 0` and a LOGGING config set the outbox loggers to WARNING, their handlers' levels often unset: the
    logger let the line through as a warning before it became an INFO line, which must then not be heard."""
    heard: list[logging.LogRecord] = []
    handler = logging.Handler()  # level NOTSET: it hears whatever the logger passes on
    handler.emit = heard.append  # type: ignore[method-assign]
    level = client_log.level
    client_log.addHandler(handler)
    client_log.setLevel(logging.WARNING)
    try:
        client_log.warning("%s [%s] %s", "rdkafka#producer-1", "GETPID", GETPID)
        client_log.warning("%s [%s] %s", "rdkafka#producer-1", "FAIL", "[thrd:main]: broker down")
    finally:
        client_log.removeHandler(handler)
        client_log.setLevel(level)
    assert [(record.levelname, record.getMessage()[-11:]) for record in heard] == [("WARNING", "broker down")]


def test_the_gapless_guarantee_warning_is_dropped(caplog):
    text = "[thrd:app]: Configuration property enable.gapless.guarantee is experimental"
    assert lines(caplog, logging.WARNING, "CONFWARN", text) == []
    assert lines(caplog, logging.WARNING, "CONFWARN", "[thrd:app]: something else")[0][0] == "WARNING"


def test_the_clients_that_only_check_the_settings_say_nothing_even_after_logging_is_configured_again(caplog):
    """`manage.py check` builds throwaway clients pointed at 127.0.0.1:1; their "Connect ... failed" is noise. A
    LOGGING dictConfig run after the module was imported (a test, a worker framework) resets every existing child of
    a logger it configures to propagate with no handlers: the silence must survive that."""
    import logging.config

    from outbox.kafka.clients import check_log

    # dictConfig resets every existing child of `outbox`: put them back as they were for the tests after this one.
    children = {name: (logger.handlers[:], logger.propagate, logger.level, logger.disabled)
                for name, logger in logging.root.manager.loggerDict.items()
                if isinstance(logger, logging.Logger) and (name == "outbox" or name.startswith("outbox."))}
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": False,
                               "handlers": {"console": {"class": "logging.StreamHandler"}},
                               "loggers": {"outbox": {"handlers": ["console"], "level": "INFO"}}})
    try:
        with caplog.at_level(logging.DEBUG):
            check_log.error("%s [%s] %s", "rdkafka#producer-1", "FAIL", "Connect to ipv4#127.0.0.1:1 failed")
        assert caplog.records == []
    finally:
        for name, (handlers, propagate, level, disabled) in children.items():
            logger = logging.getLogger(name)
            logger.handlers, logger.propagate, logger.disabled = handlers, propagate, disabled
            logger.setLevel(level)


REFUSED = ("127.0.0.1:9190/bootstrap: Connect to ipv4#127.0.0.1:9190 failed: Connection refused "
           "(after {}ms in state CONNECT)")


def fail_line(logger: logging.Logger, elapsed: int) -> None:
    """A failed connection as confluent-kafka hands it to the client's logger: (facility, client, text), at ERROR."""
    logger.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1",
               f"[thrd:127.0.0.1:9190/bootstrap]: {REFUSED.format(elapsed)}")


@pytest.mark.parametrize("name", ["outbox.harvest.librdkafka", "outbox.queue.librdkafka"])
def test_a_failed_connection_is_said_once_a_minute_with_the_error_callbacks_report(name, caplog, monkeypatch):
    """While a broker is away each client logs every failed connection (about once a second) at ERROR, and its error
    callback reports the same: one WARNING a minute for both, the repeats at DEBUG; the queues' clients as the
    harvester's."""
    import outbox.queue.clients  # noqa: F401  (the queues' client logger, as their clients get it)
    from outbox.kafka import client_errors

    monkeypatch.setattr(client_errors, "_last_logged", {})
    now = [1000.0]
    monkeypatch.setattr(client_errors, "_clock", lambda: now[0])
    logger = logging.getLogger(name)
    with caplog.at_level(logging.DEBUG, logger="outbox"):
        for elapsed in (0, 1, 30):
            now[0] = 1000.0 + elapsed
            fail_line(logger, elapsed)
        client_errors.log_client_error(KafkaError(KafkaError._TRANSPORT, REFUSED.format(31)))
        now[0] = 1061.0
        fail_line(logger, 2)
        logger.error("%s [%s] %s", "FAIL", "rdkafka#producer-1", "[thrd:b2:9092/2]: b2:9092/2: Connect to b2 failed")
    assert [(record.name, record.levelname) for record in caplog.records] == [
        (name, "WARNING"), (name, "DEBUG"), (name, "DEBUG"), ("outbox.harvest.kafka", "DEBUG"), (name, "WARNING"),
        (name, "WARNING")], "another broker's failure is its own"


def test_a_client_logger_asked_for_again_keeps_one_filter(caplog, monkeypatch):
    """A module that makes its client logger imported again (importlib.reload, a test's fresh import) must not stack a
    second filter: the failed connection is still said once at WARNING, not turned into DEBUG by the second."""
    from outbox.kafka import client_errors
    from outbox.kafka.clients import client_logger

    monkeypatch.setattr(client_errors, "_last_logged", {})
    logger = client_logger("outbox.test.librdkafka")
    assert client_logger("outbox.test.librdkafka") is logger
    with caplog.at_level(logging.DEBUG, logger="outbox"):
        fail_line(logger, 0)
    assert [record.levelname for record in caplog.records] == ["WARNING"]
    assert len(logger.filters) == 1


def test_a_reload_of_the_clients_module_keeps_one_filter():
    """importlib.reload(outbox.kafka.clients) makes a new filter class: the logger it asks for again still has one."""
    import subprocess
    import sys
    from pathlib import Path

    script = ("import importlib, logging, outbox.kafka.clients as clients; importlib.reload(clients); "
              "print(len(logging.getLogger('outbox.harvest.librdkafka').filters))")
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "1\n"), done.stderr


def test_a_queue_sender_with_no_broker_says_so_once(caplog, monkeypatch):
    """An application's send() producer (the queues' sender), its broker gone: librdkafka retries about twice a
    second, and the log has one line of it, not one a try."""
    from confluent_kafka import Producer

    from outbox.kafka import client_errors
    from outbox.queue.clients import sender_config
    from outbox.queue.config import QueueConfig
    from tests.support.waiting import wait_until

    monkeypatch.setattr(client_errors, "_last_logged", {})
    producer = Producer(sender_config(QueueConfig(base_kafka_config={"bootstrap.servers": "127.0.0.1:1"}), "app"))
    producer.produce("orders-queue", b"x")
    with caplog.at_level(logging.DEBUG, logger="outbox"):
        def tries() -> int:
            producer.poll(0.1)
            return sum("Connect to ipv4#127.0.0.1:1 failed" in record.getMessage() for record in caplog.records)

        wait_until(lambda: tries() >= 6, 30, "librdkafka to try the broker a few times")
    said = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING
            and "Connect to ipv4#127.0.0.1:1 failed" in record.getMessage()]
    assert len(said) == 1, said
    producer.purge()
