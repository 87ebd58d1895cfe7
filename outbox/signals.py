"""Django signals for harvester events; the sender is the Harvester.

    from outbox.signals import leader_acquired

    @receiver(leader_acquired)
    def start_singleton_work(sender, leader_id, **kwargs): ...

Receivers run on the harvester's engine thread: keep them short, and never block in
leader_fenced (another replica may be about to lead).
"""

from __future__ import annotations

from typing import Any

from django.dispatch import Signal

from outbox.harvest import events

leader_acquired = Signal()  # leader_id
leader_refreshed = Signal()  # leader_id
leader_revoked = Signal()
leader_fenced = Signal()
leader_blocked = Signal()  # holder: the replica (or session) holding the table's database fence
record_held = Signal()  # record_id, key, reason
record_released = Signal()  # record_id, key, how: a short phrase saying what released it
record_parked = Signal()  # record_id, key, reason
meter_read = Signal()  # stats: outbox.harvest.events.MeterStats

_SIGNALS: dict[type, Signal] = {
    events.LeaderAcquired: leader_acquired,
    events.LeaderRefreshed: leader_refreshed,
    events.LeaderRevoked: leader_revoked,
    events.LeaderFenced: leader_fenced,
    events.LeaderBlocked: leader_blocked,
    events.RecordHeld: record_held,
    events.RecordReleased: record_released,
    events.RecordParked: record_parked,
    events.MeterRead: meter_read,
}


def send_event(sender: Any, event: events.Event) -> None:
    """Send the signal matching a harvester event; a failing receiver is logged, not raised."""
    fields = {name: getattr(event, name) for name in getattr(event, "__dataclass_fields__", {})}
    _SIGNALS[type(event)].send_robust(sender=sender, event=event, **fields)
