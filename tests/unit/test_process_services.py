"""A process's shared services by key (outbox/harvest/process_services.py): the LISTEN hubs and status boards."""

from __future__ import annotations

from outbox.harvest.process_services import ProcessServices


class FakeService:
    """A service never started (stepped by its caller): `users` says whether it is empty."""

    ident = None

    def __init__(self, key: str) -> None:
        self.key, self.users, self.ended, self.started = key, 0, False, False

    @property
    def empty(self) -> bool:
        return self.users == 0

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        pass

    def end(self) -> None:
        self.ended = True

    def join(self, timeout: float | None = None) -> None:
        raise AssertionError("a service never started is ended, not joined")


def join(service: FakeService) -> FakeService:
    service.users += 1
    return service


def test_one_service_per_key_made_once_and_a_key_without_one_remembered():
    made: list[str] = []

    def make(key: str) -> FakeService | None:
        made.append(key)
        return None if key == "off" else FakeService(key)

    services: ProcessServices[FakeService] = ProcessServices(threads=False)
    first = services.use("db", lambda: make("db"), join)
    assert services.use("db", lambda: make("db"), join) is first and first.users == 2
    assert services.use("off", lambda: make("off"), join) is None
    assert services.use("off", lambda: make("off"), join) is None
    assert made == ["db", "off"], "each key's service made once, a key that has none asked once"
    assert services.running == [first] and not first.started, "without threads, nothing is started"


def test_the_last_user_leaving_ends_its_service_unless_a_new_one_came():
    services: ProcessServices[FakeService] = ProcessServices(threads=False)
    service = services.use("db", lambda: FakeService("db"), join)
    assert service is not None
    services.retire(service)
    assert not service.ended and services.running == [service], "a service with a user is not ended"
    service.users = 0
    services.retire(service)
    assert service.ended and services.running == []
    again = services.use("db", lambda: FakeService("db"), join)
    assert again is not service and again is not None, "a new user gets a new service"
    services.retire(service)
    assert not again.ended, "retiring an ended service leaves its key's new one alone"
    services.close()
    assert again.ended and services.running == []


def test_threads_start_with_their_service():
    services: ProcessServices[FakeService] = ProcessServices()
    service = services.use("db", lambda: FakeService("db"), join)
    assert service is not None and service.started
