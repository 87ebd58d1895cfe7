"""RecordProducers (outbox/harvest/producers.py): a producer is rebuilt for smaller batches only once it has nothing
left to report, and one replaced after a fatal error is served until it has reported everything, then the core told."""

from __future__ import annotations

from outbox.harvest.producers import RecordProducers
from outbox.kafka.sizes import UNLIMITED


class Producer:
    """A producer holding `outstanding` records not yet reported."""

    def __init__(self, batch_limit: int | None) -> None:
        self.batch_limit = batch_limit
        self.outstanding = 0
        self.purged = False
        self.polls = 0

    def __len__(self) -> int:
        return self.outstanding

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True) -> None:
        self.purged = True

    def poll(self, timeout: float = 0) -> int:
        self.polls += 1
        return 0

    def flush(self, timeout: float = 0) -> int:
        return self.outstanding


def producers() -> tuple[RecordProducers, list[str]]:
    told: list[str] = []
    return RecordProducers(Producer, UNLIMITED, lambda: told.append("restarted")), told


def test_batches_are_fitted_to_a_smaller_limit_once_the_producer_has_reported_what_it_holds():
    records, _ = producers()
    first = records.current
    assert first.batch_limit is None, "built as configured"
    first.outstanding = 2
    assert records.fit(1000) is False and records.current is first, "not while it holds records"
    first.outstanding = 0
    assert records.fit(1000) is True and records.current is not first
    assert records.current.batch_limit == 1000 and records.batch_limit == 1000
    rebuilt = records.current
    assert records.fit(5000) is True and records.current is rebuilt, "a larger limit needs nothing"


def test_a_producer_replaced_after_a_fatal_error_is_served_until_it_has_reported_everything():
    records, told = producers()
    assert records.fit(1000)
    old = records.current
    old.outstanding = 3
    records.restart()
    assert old.purged and records.current is not old and records.retiring == [old]
    assert records.current.batch_limit == 1000, "the new one fits the same limit"
    poll = lambda producer, timeout: producer.poll(timeout)  # noqa: E731
    records.serve_retiring(poll)
    assert old.polls == 1 and told == [] and records.retiring == [old], "still reporting"
    assert records.fit(500) is False, "no rebuild while a replaced producer still reports"
    old.outstanding = 0
    records.serve_retiring(poll)
    assert told == ["restarted"] and records.retiring == []
    records.serve_retiring(poll)
    assert told == ["restarted"], "told once"
