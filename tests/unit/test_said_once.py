"""outbox.logs.SaidOnce: a failure that recurs every interval is said once, and its end once."""

from __future__ import annotations

import logging

from outbox.logs import SaidOnce


def test_a_recurring_failure_is_said_once_until_it_ends_then_again(caplog):
    log = logging.getLogger("outbox.test")
    outage = SaidOnce(log, "Down (tried every %gs): %s", "Back")
    with caplog.at_level(logging.INFO, logger="outbox.test"):
        outage.ended()  # nothing failed: nothing to say
        for reason in ("refused", "refused", "timed out"):
            outage.failed(5.0, reason)
        outage.ended()
        outage.ended()
        outage.failed(5.0, "refused")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "Down (tried every 5s): refused"), ("INFO", "Back"), ("WARNING", "Down (tried every 5s): refused")]
    assert outage.on


def test_without_an_end_message_the_end_is_silent(caplog):
    outage = SaidOnce(logging.getLogger("outbox.test"), "Failed: %s")
    with caplog.at_level(logging.INFO, logger="outbox.test"):
        outage.failed("x")
        outage.ended()
    assert [r.getMessage() for r in caplog.records] == ["Failed: x"] and not outage.on
