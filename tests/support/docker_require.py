"""Skip a Docker test whose engine, tool or image is missing; fail instead under REQUIRE_DOCKER_TESTS=1.

`make test-docker` (and so CI) sets it: a run meant to test the Docker paths cannot pass without them.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def unavailable(reason: str) -> NoReturn:
    if os.environ.get("REQUIRE_DOCKER_TESTS") == "1":
        pytest.fail(f"{reason} (REQUIRE_DOCKER_TESTS=1)", pytrace=False)
    pytest.skip(reason)
