"""The Docker tests: they run where a Docker engine answers (DOCKER_HOST or the usual socket)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.docker_require import unavailable
from tests.support.services import docker_client


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[Any]:
    client = docker_client()
    if client is None:
        unavailable(f"no Docker engine answers at {os.environ.get('DOCKER_HOST') or 'unix:///var/run/docker.sock'}")
    with contextlib.closing(client):
        yield client
