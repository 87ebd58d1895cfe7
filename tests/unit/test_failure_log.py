"""A handler's failure is logged as what its backend does next: the markers backend's tracker redelivers after the
redelivery timeout (the traceback in the same line); the share backend's broker redelivers at once, or the last
delivery is dead-lettered (one line; the traceback at DEBUG, since a failing handler fails every few milliseconds)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from outbox.queue.config import QueueLimits
from outbox.queue.markers_consumer import QueueConsumer
from outbox.queue.share_consumer import ShareQueueConsumer


@pytest.mark.parametrize(("deliveries", "said"), [
    (1, "released: the broker redelivers it at once (delivery 1 of 5)"),
    (5, "dead-lettered (delivery 5 of 5)"),
])
def test_the_share_backend_says_what_the_broker_does(deliveries: int, said: str) -> None:
    consumer = SimpleNamespace(limits=QueueLimits(backend="share"))
    assert ShareQueueConsumer._after_failure(consumer, SimpleNamespace(deliveries=deliveries)) == (said, False)


def test_without_a_limit_nothing_is_dead_lettered() -> None:
    consumer = SimpleNamespace(limits=QueueLimits(backend="share", max_deliveries=None))
    assert ShareQueueConsumer._after_failure(consumer, SimpleNamespace(deliveries=99)) == \
        ("released: the broker redelivers it at once (delivery 99)", False)


def test_the_markers_backend_says_when_its_tracker_redelivers() -> None:
    consumer = SimpleNamespace(limits=QueueLimits(redelivery_timeout=30))
    assert QueueConsumer._after_failure(consumer, SimpleNamespace(deliveries=4)) == \
        ("redelivered after the redelivery timeout (30 s)", True)


def test_the_markers_backend_says_the_last_delivery_becomes_a_dead_letter() -> None:
    """The tracker moves a message whose last delivery (max_deliveries) was abandoned to the dead letters once its
    deadline passes (tracker_state.due): the consumer's line must not promise a redelivery."""
    consumer = SimpleNamespace(limits=QueueLimits(redelivery_timeout=5, max_deliveries=3))
    assert QueueConsumer._after_failure(consumer, SimpleNamespace(deliveries=3)) == \
        ("a dead letter after the redelivery timeout (5 s): delivery 3 of 3", True)
    unlimited = SimpleNamespace(limits=QueueLimits(redelivery_timeout=5, max_deliveries=None))
    assert QueueConsumer._after_failure(unlimited, SimpleNamespace(deliveries=99))[0].startswith("redelivered")


def test_the_warning_is_one_line_when_the_backend_says_so(caplog: pytest.LogCaptureFixture) -> None:
    from outbox.queue import handling

    settled = []
    message = SimpleNamespace(span=None, after_failure=lambda: ("released: the broker redelivers it at once", False),
                              abandon=lambda: settled.append("abandoned"))

    def handler(_: object) -> None:
        raise RuntimeError("mail server down")

    with caplog.at_level(logging.DEBUG, logger="outbox.queue.handling"):
        assert handling.handle(message, handler) is handling.Outcome.FAILED  # type: ignore[arg-type]
    warning, debug = caplog.records
    assert (warning.levelno, warning.exc_info) == (logging.WARNING, False)  # no traceback with it
    assert warning.getMessage().endswith(": RuntimeError: mail server down; no ack, released: the broker "
                                         "redelivers it at once")
    assert (debug.levelno, debug.exc_info[0]) == (logging.DEBUG, RuntimeError)
    assert settled == ["abandoned"]
