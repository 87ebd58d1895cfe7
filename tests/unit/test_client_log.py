"""librdkafka's own log lines, as the outbox's clients hand them to Python logging (outbox.kafka.clients)."""

from __future__ import annotations

import logging

import pytest

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
