"""The Docker tests: they run where a Docker engine answers (DOCKER_HOST or the usual socket)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.docker_require import unavailable
from tests.support.services import docker_client, docker_host


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[Any]:
    client = docker_client()
    if client is None:
        unavailable(f"no Docker engine answers at {docker_host()}")
    with contextlib.closing(client):
        yield client
