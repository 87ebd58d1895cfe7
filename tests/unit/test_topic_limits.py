"""TopicLimits.stale: a record over its topic's limit waits for an old limit to be read again, once, and not long."""

from __future__ import annotations

from outbox.harvest.topics import TopicLimits


def test_an_old_limit_is_read_again_once_before_a_record_over_it_is_held():
    answers, now = {"orders": 3000}, [0.0]
    limits = TopicLimits(lambda topics: {t: answers[t] for t in topics}, refresh_interval=60, clock=lambda: now[0])
    limits.limit("orders")
    limits.learn()
    assert limits.limit("orders") == 3000
    assert not limits.stale("orders", 5.0), "read a moment ago: held at once"
    now[0] = 10.0
    answers["orders"] = 100_000  # an operator raised it
    assert limits.stale("orders", 5.0) and limits.changed.is_set(), "asked for again: the record waits"
    now[0] = 10.2
    assert limits.stale("orders", 5.0), "still being read: it waits on"
    limits.learn()
    assert limits.limit("orders") == 100_000 and not limits.stale("orders", 5.0)


def test_a_limit_that_cannot_be_read_again_is_waited_for_only_a_while():
    def describe(topics):
        if now[0] > 0:
            raise RuntimeError("the brokers do not answer")
        return {t: 3000 for t in topics}

    now = [0.0]
    limits = TopicLimits(describe, refresh_interval=60, clock=lambda: now[0])
    limits.limit("orders")
    limits.learn()
    now[0] = 10.0
    assert limits.stale("orders", 5.0)
    limits.learn()  # fails: the old limit is kept
    now[0] = 16.0
    assert limits.limit("orders") == 3000 and not limits.stale("orders", 5.0), "held on the old limit, as before"
    assert not limits.stale("orders", 5.0), "and not asked for again at every record"
