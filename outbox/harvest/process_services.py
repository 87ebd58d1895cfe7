"""A process's shared services by key: one LISTEN hub per database (notify_hub.py), one status writer per status
table (status_board.py). The first engine that needs one makes it, and it ends once its last engine left, so a
process holds a session per database, not per engine, whatever the number of its engines."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, Protocol, TypeVar


class Service(Protocol):
    """A thread serving the engines of one key (or, never started, stepped by its caller)."""

    ident: int | None

    @property
    def empty(self) -> bool: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def end(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...


S = TypeVar("S", bound=Service)
T = TypeVar("T")


class ProcessServices(Generic[S]):
    """The services by key; without `threads` none is started: the caller steps each (as the unit tests do)."""

    def __init__(self, *, threads: bool = True) -> None:
        self._threads = threads
        self._lock = threading.Lock()
        self._services: dict[Hashable, S | None] = {}

    def use(self, key: Hashable, make: Callable[[], S | None], use: Callable[[S], T]) -> T | None:
        """`use(service)` for `key`'s service, made by `make` if it has none (None: none can be had there, which is
        remembered). Under the lock retire() takes, so no service is ended under a new user."""
        with self._lock:
            if key not in self._services:
                made = self._services[key] = make()
                if made is not None and self._threads:
                    made.start()
            service = self._services[key]
            return None if service is None else use(service)

    def retire(self, service: S) -> None:
        """`service`'s last user left: end it, unless a new one came meanwhile."""
        with self._lock:
            key = next((key for key, found in self._services.items() if found is service), None)
            if key is None or not service.empty:
                return
            del self._services[key]
        _end(service)

    @property
    def running(self) -> list[S]:
        with self._lock:
            return [service for service in self._services.values() if service is not None]

    def close(self) -> None:
        """End every service (a user that comes after gets a new one)."""
        with self._lock:
            services, self._services = [service for service in self._services.values() if service is not None], {}
        for service in services:
            service.stop()
        for service in services:
            _end(service)


def _end(service: Service) -> None:
    """Stop the service and wait for its thread to end (or end it here: one that was stepped, never started)."""
    service.stop()
    if service.ident is None:
        service.end()
    else:
        service.join(timeout=10)
