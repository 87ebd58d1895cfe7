"""Every harvester event reaches a Django signal with its fields as keyword arguments."""

from __future__ import annotations

import typing

from django.dispatch import receiver

from outbox import signals
from outbox.harvest import events


def test_every_event_type_has_a_signal() -> None:
    missing = [kind.__name__ for kind in typing.get_args(events.Event) if kind not in signals._SIGNALS]
    assert not missing, f"events without a signal: {missing}"


def test_a_record_held_event_reaches_its_receiver_with_its_fields() -> None:
    received: list[dict[str, object]] = []

    @receiver(signals.record_held)
    def on_held(sender: object, **kwargs: object) -> None:
        received.append({"sender": sender, **kwargs})

    try:
        event = events.RecordHeld(record_id=7, key="order-1", reason="MSG_SIZE_TOO_LARGE")
        signals.send_event("harvester", event)
    finally:
        signals.record_held.disconnect(on_held)
    assert received == [{"sender": "harvester", "signal": signals.record_held, "event": event,
                         "record_id": 7, "key": "order-1", "reason": "MSG_SIZE_TOO_LARGE"}]


def test_a_failing_receiver_does_not_break_the_sender() -> None:
    def broken(sender: object, **kwargs: object) -> None:
        raise RuntimeError("receiver bug")

    signals.leader_blocked.connect(broken)
    try:
        signals.send_event("harvester", events.LeaderBlocked(holder="replica-2 on host-b"))
    finally:
        signals.leader_blocked.disconnect(broken)
