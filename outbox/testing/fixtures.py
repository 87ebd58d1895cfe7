"""The fixtures of `outbox.testing` for pytest-django (plugin.py registers them)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest

from outbox.testing import StashedRecord, capture_stashed
from outbox.testing.harvesting import Published


@pytest.fixture
def outbox_stashed(db: None) -> Callable[..., AbstractContextManager[list[StashedRecord]]]:
    """`with outbox_stashed() as records:` the records stashed inside the block (capture_stashed), as
    pytest-django's django_capture_on_commit_callbacks is for on_commit callbacks."""
    return capture_stashed




@pytest.fixture
def outbox_harvest(db: None) -> Callable[..., list[Published]]:
    """`outbox_harvest()`: publish what is in the outbox with the real engine to an in-memory Kafka, and return it
    (harvesting.harvest)."""
    from outbox.testing.harvesting import harvest

    return harvest
