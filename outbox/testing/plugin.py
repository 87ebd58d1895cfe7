"""The pytest plugin of `outbox.testing` (registered through the `pytest11` entry point `outbox`).

It adds its fixtures only when pytest-django is active (they stand on its database access), and imports
nothing of Django until a fixture runs, so a project without pytest-django, or a suite that never uses
them, notices nothing. `-p no:outbox` turns it off.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("django"):
        from outbox.testing import fixtures

        config.pluginmanager.register(fixtures, "outbox.testing.fixtures")
