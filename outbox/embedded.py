"""Run a harvester inside another Django process (a web worker, a Celery worker...).

    from outbox import create_harvester
    harvester = create_harvester()
    harvester.start()
    ...
    harvester.stop(); harvester.wait()
"""

from __future__ import annotations

from typing import Any

from outbox import conf, signals
from outbox.harvest.harvester import Harvester
from outbox.harvest.instruments import Instruments


def create_harvester(*, instruments: Instruments | None = None, **overrides: Any) -> Harvester:
    """A Harvester configured from settings.OUTBOX (plus overrides) whose events become Django signals."""
    holder: list[Harvester] = []
    harvester = Harvester(conf.harvest_config(**overrides), instruments=instruments,
                          on_event=lambda event: signals.send_event(holder[0], event))
    holder.append(harvester)
    return harvester
