"""Message queues against the real broker: delivery, acks, keep-alives, crashes of consumers and
trackers, many queues on one topic pair, dead letters and the inbox.

Consumers and trackers run in this process where the test watches their state, and as
`manage.py` subprocesses where one must die by SIGKILL. Timeouts are short (2 s redelivery).
"""

from __future__ import annotations

import collections
import signal
import socket
import time
import urllib.request

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer
from django.db import transaction

from outbox.queue import api, app_settings
from outbox.queue.errors import QueueError, Retry
from outbox.queue.markers_consumer import QueueConsumer
from outbox.queue.models import DeadLetter, InboxEntry, QueueCounter
from outbox.queue.runner import HandlerRunner
from outbox.queue.topics import ensure_topics
from project.shop.models import Order
from tests.support.harness import Process, wait_until
from tests.support.queue_harness import (
    REDELIVERY_TIMEOUT,
    consumer_args,
    events,
    group_members,
    new_prefix,
    process_env,
    queue_settings,
    read_queue_topic,
    running_harvester,
    running_tracker,
)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def prefix(settings, bootstrap_servers):
    """OUTBOX["queues"] on a fresh topic pair (4 and 2 partitions), created before anyone uses it."""
    name = new_prefix()
    settings.OUTBOX = {**settings.OUTBOX, "queues": queue_settings(name)}
    ensure_topics(app_settings.queue_config(), 10)
    return name


@pytest.fixture
def config(prefix):
    return app_settings.queue_config()


@pytest.fixture
def event_log(tmp_path):
    return tmp_path / "events.log"


def ended(tracker, queue: str, count: int) -> bool:
    """The tracker read `count` End markers of `queue` and holds nothing of it in progress."""
    view = tracker.snapshot
    return view.ends.get(queue, 0) >= count and queue not in view.queues


def test_messages_are_delivered_to_their_queue_only_and_acked_ones_are_never_redelivered(config, bootstrap_servers):
    ids = api.send_many("alpha", [{"n": n} for n in range(20)], headers=[("trace", "t-1")])
    other = api.send("beta", "for beta")
    received = {}
    with running_tracker(config) as tracker, api.consumer("alpha", max_in_progress=8) as consumer:
        while len(received) < 20:
            message = wait_until(lambda: consumer.receive(timeout=0.5), 30, "alpha's messages")
            assert message.queue == "alpha" and message.deliveries == 1
            assert message.headers == [("trace", "t-1")]
            received[message.id] = message.json()["n"]
            assert consumer.in_progress <= 8, "back-pressure: at most max_in_progress held"
            message.ack()
        wait_until(lambda: ended(tracker, "alpha", 20), 30, "the tracker to read alpha's 20 End markers")
        assert tracker.snapshot.redelivered == {}
    assert received == {message_id: n for n, message_id in enumerate(ids)}
    assert other not in received


def test_a_tracker_restarted_at_its_committed_end_or_on_an_empty_partition_is_not_replaying(config):
    """librdkafka's position() stays unknown until a record of a partition is consumed: the tracker counts a
    markers partition read to its end by the end-of-partition event, so neither an empty partition nor one whose
    committed offset is its end shows as replaying (the console said so for ever)."""
    with running_tracker(config) as tracker:  # both markers partitions empty
        wait_until(lambda: tracker.snapshot.partitions == [0, 1] and tracker.snapshot.replaying == [], 30,
                   "both empty markers partitions read to their end")
    with api.consumer("alpha") as consumer:
        api.send("alpha", {"n": 1})
        wait_until(lambda: consumer.receive(timeout=0.5), 30, "the message").ack()
    with running_tracker(config) as tracker:
        wait_until(lambda: ended(tracker, "alpha", 1), 30, "the End marker")
    with running_tracker(config) as tracker:  # committed at the end of the partition that has the markers
        wait_until(lambda: tracker.snapshot.partitions == [0, 1] and tracker.snapshot.replaying == [], 30,
                   "both markers partitions read to their end after a restart")
        assert tracker.snapshot.starts == {} and tracker.snapshot.ends == {}, "nothing read again"


def test_a_stashed_message_is_published_by_the_harvester_with_its_id(config, database_url, bootstrap_servers):
    with transaction.atomic():
        order = Order.objects.create(item="lamp")
        message_id = api.stash("confirmations", {"order": order.pk}, headers={"source": "shop"})
    with running_harvester(database_url, bootstrap_servers), api.consumer("confirmations") as consumer:
        message = wait_until(lambda: consumer.receive(timeout=0.5), 30, "the stashed message")
        message.ack()
    assert message.id == message_id and message.json() == {"order": order.pk}
    names = [name for name, _ in message.headers]
    assert ("source", "shop") in message.headers and "outbox-id" in names
    assert message.key.decode() == f"confirmations/{message_id}"


def test_a_consumer_killed_mid_message_has_it_redelivered_and_processed_once_to_the_end(
        config, database_url, bootstrap_servers, prefix, event_log, tmp_path):
    env = process_env(database_url, bootstrap_servers, prefix, event_log, mode="sleep:60")
    message_id = api.send("jobs", "work")
    with running_tracker(config) as tracker:
        first = Process("consumer-1", "outbox_consume", consumer_args("jobs"), env, tmp_path)
        try:
            wait_until(lambda: [e for e in events(event_log) if e.event == "start"], 60, "the first consumer to start")
            second = Process("consumer-2", "outbox_consume", consumer_args("jobs"), env, tmp_path)
            first.kill()
            done = wait_until(lambda: [e for e in events(event_log) if e.event == "done"], 60,
                              "the redelivered message to be processed")
            wait_until(lambda: ended(tracker, "jobs", 2), 30, "the tracker to see both deliveries end")
        finally:
            first.kill()
            second.signal(signal.SIGTERM)
            assert second.wait() == 0, second.log()
    starts = [e for e in events(event_log) if e.event == "start"]
    assert [(e.id, e.delivery, e.pid) for e in starts] == [(message_id, 1, first.pid), (message_id, 2, second.pid)]
    assert [(e.id, e.delivery, e.pid) for e in done] == [(message_id, 2, second.pid)]
    assert tracker.snapshot.redelivered == {"jobs": 1}


def test_a_handler_three_times_longer_than_the_timeout_is_kept_alive_and_never_redelivered(config):
    api.send("reports", "long one")
    with running_tracker(config) as tracker, api.consumer("reports") as consumer:
        message = wait_until(lambda: consumer.receive(timeout=0.5), 30, "the message")
        time.sleep(3 * REDELIVERY_TIMEOUT)  # the handler's work, while keep-alives flow
        message.ack()
        wait_until(lambda: ended(tracker, "reports", 1), 30, "the tracker to read the End marker")
        assert tracker.snapshot.redelivered == {}, "a keep-alive arrived before every deadline"
        assert tracker.snapshot.starts == {"reports": 1}
    assert consumer.received == 1 and consumer.acked == 1


def test_a_tracker_killed_and_restarted_rebuilds_from_the_markers_log(config, database_url, bootstrap_servers, prefix,
                                                                      event_log, tmp_path):
    """Nothing lost, nothing redelivered twice: each abandoned message is redelivered exactly once."""
    env = process_env(database_url, bootstrap_servers, prefix, event_log)
    ids = api.send_many("tasks", [f"task {n}" for n in range(12)])
    first = Process("tracker-1", "outbox_redeliver", [], env, tmp_path)
    second = None
    try:
        with api.consumer("tasks", max_in_progress=12) as consumer:
            held = [wait_until(lambda: consumer.receive(timeout=0.5), 30, "a message") for _ in range(12)]
            for message in held[:4]:
                message.ack()
            for message in held[4:8]:
                message.abandon()  # as if its process died: redelivered after the timeout
            wait_until(lambda: sum(r.deliveries == 2 for r in read_queue_topic(bootstrap_servers, config.topic)) == 4,
                       30, "the first tracker to redeliver 4 messages")
            for message in held[8:]:
                message.abandon()
            first.kill()  # the last four are due soon: the restarted tracker must find them in the log
            second = Process("tracker-2", "outbox_redeliver", [], env, tmp_path)
            redelivered = []
            while len(redelivered) < 8:
                message = wait_until(lambda: consumer.receive(timeout=0.5), 60, "redelivered messages")
                assert message.deliveries == 2
                redelivered.append(message.id)
                message.ack()
        records = read_queue_topic(bootstrap_servers, config.topic)
    finally:
        first.kill()
        if second is not None:
            second.signal(signal.SIGTERM)
            assert second.wait() == 0, second.log()
    copies = collections.Counter(r.id for r in records)
    assert sorted(redelivered) == sorted(m.id for m in held[4:])
    assert {i: copies[i] for i in ids} == {i: (1 if i in {m.id for m in held[:4]} else 2) for i in ids}
    assert "Tracking markers partition(s)" in second.log()


def test_two_trackers_and_four_consumers_over_three_queues_on_one_topic_pair(
        config, database_url, bootstrap_servers, prefix, event_log, tmp_path):
    env = process_env(database_url, bootstrap_servers, prefix, event_log, mode="flaky")
    processes = [Process(f"tracker-{n}", "outbox_redeliver", [], env, tmp_path) for n in (1, 2)]
    processes += [Process(f"{queue}-{n}", "outbox_consume", consumer_args(queue, "--workers", "2"), env, tmp_path)
                  for queue, n in (("red", 1), ("red", 2), ("green", 1), ("blue", 1))]
    try:
        groups = {config.tracker_group: 2, config.consumer_group("red"): 2, config.consumer_group("green"): 1,
                  config.consumer_group("blue"): 1}
        wait_until(lambda: all(group_members(config, g) == n for g, n in groups.items()), 60,
                   "every process to hold partitions in its group (two per group for trackers and red)")
        sent = {queue: set(api.send_many(queue, [f"{queue} {n}" for n in range(30)]))
                for queue in ("red", "green", "blue")}

        def all_done() -> bool:
            done = {(e.queue, e.id) for e in events(event_log) if e.event == "done"}
            return done >= {(queue, i) for queue, ids in sent.items() for i in ids}

        wait_until(all_done, 120, "every message of the three queues to be processed")
    finally:
        for process in processes:
            process.signal(signal.SIGTERM)
        codes = {process.name: process.wait() for process in processes}
    assert codes == {process.name: 0 for process in processes}, [p.log()[-2000:] for p in processes]
    log = events(event_log)
    by_pid = {p.pid: p.name.split("-")[0] for p in processes}
    assert all(by_pid[e.pid] == e.queue for e in log), "a consumer saw only its own queue's messages"
    done = collections.Counter((e.queue, e.id) for e in log if e.event == "done")
    assert set(done.values()) == {1}, "no message was processed to the end twice"
    failed = {(e.queue, e.id) for e in log if e.event in ("fail", "retry")}
    assert failed, "the flaky handler failed some first deliveries"
    assert all(any(e.event == "done" and (e.queue, e.id) == f and e.delivery == 2 for e in log) for f in failed)
    assert {e.pid for e in log if e.queue == "red"} == {processes[2].pid, processes[3].pid}, "both red consumers"
    counters = {c.queue: c.redelivered for c in QueueCounter.objects.all()}
    assert sum(counters.values()) == len(failed)


def test_a_message_delivered_max_deliveries_times_goes_to_the_dead_letters(config):
    message_id = api.send("fragile", {"x": 1}, headers=[("trace", "t-9")])
    deliveries = []

    def always_retry(message):
        deliveries.append(message.deliveries)
        raise Retry("not today")

    with running_tracker(config) as tracker, api.consumer("fragile", max_deliveries=3) as consumer:
        runner = HandlerRunner(consumer, always_retry)
        runner.start()
        try:
            letter = wait_until(lambda: DeadLetter.objects.filter(message_id=message_id).first(), 60,
                                "the dead letter")
            wait_until(lambda: ended(tracker, "fragile", 3), 30, "the tracker to end all three deliveries")
        finally:
            runner.stop()
            runner.join()
    assert deliveries == [1, 2, 3]
    assert (letter.queue, letter.deliveries, letter.text, letter.headers) == ("fragile", 3, '{"x":1}',
                                                                             [["trace", "t-9"]])
    assert tracker.snapshot.dead_lettered == {"fragile": 1} and tracker.snapshot.redelivered == {"fragile": 2}


def test_the_inbox_acks_a_redelivered_message_whose_effects_committed_without_running_it_again(
        config, database_url, bootstrap_servers, prefix, event_log, tmp_path):
    env = process_env(database_url, bootstrap_servers, prefix, event_log)
    args = consumer_args("orders", "--inbox", handler="tests.support.queue_handlers.order_then_crash")
    message_id = api.send("orders", "place it")
    with running_tracker(config) as tracker:
        first = Process("consumer-1", "outbox_consume", args, env, tmp_path)
        assert first.wait(timeout=60) == -signal.SIGKILL, "the handler's commit hook kills the process"
        second = Process("consumer-2", "outbox_consume", args, env, tmp_path)
        try:
            wait_until(lambda: ended(tracker, "orders", 2), 60, "the redelivery to be acked")
        finally:
            second.signal(signal.SIGTERM)
            assert second.wait() == 0, second.log()
    assert [(e.event, e.delivery) for e in events(event_log)] == [("ran", 1)], "the handler ran once"
    assert Order.objects.filter(item=message_id).count() == 1
    assert InboxEntry.objects.filter(queue="orders", message_id=message_id).count() == 1
    assert "processed before (inbox): acked without running the handler" in second.log()
    assert tracker.snapshot.redelivered == {"orders": 1}


class FailingFirstCommit:
    """A transactional producer whose first commit fails as a lost broker connection would: abort required."""

    def __init__(self, config):
        self._producer = Producer(config)
        self.failed = 0

    def commit_transaction(self, *args):
        if not self.failed:
            self.failed += 1
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "injected: commit failed", txn_requires_abort=True))
        return self._producer.commit_transaction(*args)

    def __getattr__(self, name):
        return getattr(self._producer, name)


def test_a_failed_start_transaction_leaves_no_trace_and_the_batch_is_read_again(config):
    """The Start marker and the offset commit are one transaction (kafka-mq-go's scenario 3)."""
    producers = []

    def producer_factory(kafka_config):
        if "transactional.id" not in kafka_config:
            return Producer(kafka_config)
        producers.append(FailingFirstCommit(kafka_config))
        return producers[-1]

    message_id = api.send("atomic", "once")
    with running_tracker(config) as tracker, \
            QueueConsumer(config, "atomic", producer_factory=producer_factory).start() as consumer:
        message = wait_until(lambda: consumer.receive(timeout=0.5), 30, "the message, read again after the abort")
        message.ack()
        wait_until(lambda: ended(tracker, "atomic", 1), 30, "the End marker")
    assert producers[0].failed == 1
    assert (message.id, message.deliveries) == (message_id, 1)
    assert tracker.snapshot.starts == {"atomic": 1}, "the aborted Start marker is invisible to the tracker"
    assert tracker.snapshot.redelivered == {}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def test_sigterm_finishes_the_message_in_hand_releases_the_rest_and_exits_0(
        config, database_url, bootstrap_servers, prefix, event_log, tmp_path):
    ids = api.send_many("mail", ["a", "b", "c"])
    consumer_port, tracker_port = free_port(), free_port()
    slow = process_env(database_url, bootstrap_servers, prefix, event_log, mode="sleep:15")
    tracker = Process("tracker", "outbox_redeliver", ["--metrics-port", str(tracker_port)], slow, tmp_path)
    first = Process("consumer-1", "outbox_consume", consumer_args("mail", "--metrics-port", str(consumer_port)), slow,
                    tmp_path)
    second = None
    try:
        in_hand = wait_until(lambda: [e for e in events(event_log) if e.event == "start"], 60, "a message in hand")[0]
        expected = ['outbox_queue_messages_received_total{queue="mail"} 1.0',
                    'outbox_queue_consumer_in_progress{name="consumer-1",queue="mail"} 3.0']
        wait_until(lambda: all(line in scrape(consumer_port) for line in expected), 10,
                   "the consumer's metrics: one message received, three held")
        first.signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0, first.log()
        done = [e for e in events(event_log) if e.event == "done"]
        assert [(e.id, e.pid) for e in done] == [(in_hand.id, first.pid)], "the message in hand was finished"
        assert "released 2" in first.log()
        second = Process("consumer-2", "outbox_consume", consumer_args("mail"),
                         process_env(database_url, bootstrap_servers, prefix, event_log), tmp_path)
        wait_until(lambda: {e.id for e in events(event_log) if e.event == "done"} == set(ids), 60,
                   "the released messages to be processed by the next consumer")
        tracker_metrics = scrape(tracker_port)
    finally:
        for process in (first, second, tracker):
            if process is not None:
                process.signal(signal.SIGTERM)
                process.wait()
    later = [e for e in events(event_log) if e.event == "done" and e.pid == second.pid]
    assert sorted(e.id for e in later) == sorted(set(ids) - {in_hand.id})
    assert all(e.delivery == 1 for e in later), "a released message was never handled: no delivery counted"
    assert 'outbox_queue_messages_redelivered_total{queue="mail"} 2.0' in tracker_metrics


def test_the_example_shop_confirms_an_order_through_its_queue(config, database_url, bootstrap_servers):
    from django.test import Client

    from outbox.models import OutboxRecord
    from project.shop.handlers import confirm_order

    response = Client(HTTP_HOST="127.0.0.1").post("/", {"item": "teapot", "quantity": 2})
    assert response.status_code == 302
    order = Order.objects.get(item="teapot")
    assert order.confirmed is None
    assert sorted(OutboxRecord.objects.values_list("kafka_topic", flat=True)) == sorted(["orders", config.topic])
    with running_harvester(database_url, bootstrap_servers), api.consumer("order-confirmations") as consumer:
        runner = HandlerRunner(consumer, confirm_order, inbox=True)
        runner.start()
        try:
            wait_until(lambda: Order.objects.get(pk=order.pk).confirmed, 30, "the order to be confirmed")
        finally:
            runner.stop()
            runner.join()
    assert consumer.acked == 1 and InboxEntry.objects.filter(queue="order-confirmations").count() == 1


def test_a_broker_without_transactions_is_one_clear_error(config):
    class NoTransactions:
        def __init__(self, kafka_config):
            self._producer = Producer(kafka_config)

        def init_transactions(self, timeout):
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "Failed to initialize Producer ID: timed out"))

        def __getattr__(self, name):
            return getattr(self._producer, name)

    with pytest.raises(QueueError) as caught:
        QueueConsumer(config, "q", producer_factory=NoTransactions).start()
    bootstrap = config.base_kafka_config["bootstrap.servers"]
    assert str(caught.value).startswith(f"cannot start Kafka transactions at {bootstrap}: Failed to initialize")
    assert "transaction.state.log.replication.factor=1" in str(caught.value)
