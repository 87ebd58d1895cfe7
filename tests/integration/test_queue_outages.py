"""Queue processes through a restart of the only broker (`bin/services up --spare`, a broker of the tests' own)
and through a database outage: `outbox_consume` (both backends, and with `--inbox`) and `outbox_redeliver` keep
running, say what they wait for and when they resumed, and every message is handled; none is lost, and an
inbox consumer's effects are written once."""

from __future__ import annotations

import collections
import re
import signal
import time

import pytest

from outbox.queue import api
from project.bench.proxy import proxied_url
from tests.support.commands import manage
from tests.support.harness import Process, wait_until
from tests.support.kafka_cluster import Cluster
from tests.support.metrics import scrape
from tests.support.queue_harness import (
    consumer_args,
    events,
    new_prefix,
    process_env,
    queue_settings,
    share_groups_missing,
)
from tests.support.services import free_port

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

MESSAGES = 1000
#: How long the broker stays down: longer than the consumers' session timeout, so groups rebalance, and than a
#: call stuck in librdkafka takes to be given up (transactional.py).
DOWN_FOR = 16.0
#: The consumers' session timeout (clients.GROUP_TIMEOUTS) plus 15 s: the bound on resuming after the broker's return.
RESUME_BOUND = 10.0 + 15.0


@pytest.fixture
def broker(spare_broker: Cluster):
    """The spare broker, running before and after."""
    spare_broker.up()
    yield spare_broker
    spare_broker.up()


def _handled(log_path) -> set[str]:
    return {e.id for e in events(log_path) if e.event == "done"}


@pytest.mark.slow
@pytest.mark.postgres_agnostic  # a restart of Kafka's only broker: the same on any PostgreSQL server
@pytest.mark.parametrize("backend", ["markers", "share"])
def test_a_broker_restart_ends_no_queue_process_and_loses_no_message(backend, broker, settings, database_url,
                                                                     tmp_path):
    """Slow: the broker stays down 16 s and the consumers resume after it."""
    if backend == "share" and (reason := share_groups_missing(broker.bootstrap_servers)) is not None:
        pytest.skip(f"the spare broker has no share groups: {reason}")
    prefix = new_prefix()
    settings.OUTBOX = {**settings.OUTBOX, "base_kafka_config": broker.client_config(),
                       "queues": queue_settings(prefix, backend=backend)}
    log_path = tmp_path / "events.log"
    env = {**process_env(database_url, broker.bootstrap_servers, prefix, log_path, mode="quick"),
           "OUTBOX_QUEUE_BACKEND": backend}
    port = free_port()
    args = ["--queue", "iota", "--handler", "tests.support.queue_handlers.record", "--workers", "2",
            "--metrics-port", str(port), "--metrics-address", "127.0.0.1"]
    processes = [Process("consumer", "outbox_consume", args, env, tmp_path)]
    if backend == "markers":
        processes.append(Process("tracker", "outbox_redeliver", [], env, tmp_path))
    try:
        before = set(api.send_many("iota", [{"n": n} for n in range(MESSAGES)]))
        wait_until(lambda: len(_handled(log_path) & before) >= MESSAGES // 3, 90, "a third of the messages handled")
        stopped_at = time.monotonic()
        broker.stop(1)
        waiting = wait_until(lambda: scrape(port).get('outbox_queue_waiting_seconds{name="consumer",queue="iota"}'),
                             DOWN_FOR, "the consumer to say it waits for Kafka")
        health = wait_until(lambda: (r := manage("outbox_queue_health", "--any", env=env)).stdout.startswith("ok")
                            and "waiting for Kafka" in r.stdout and r, DOWN_FOR, "the probe to see the wait")
        assert health.returncode == 0, health.stdout  # riding through a short outage is healthy
        time.sleep(max(0.0, DOWN_FOR - (time.monotonic() - stopped_at)))  # the outage itself: only time to wait for
        assert all(p.process.poll() is None for p in processes), "a process ended while the broker was down:\n" + \
            "".join(p.log() for p in processes)
        broker.up()
        back_at = time.monotonic()
        handled_at_return = len(_handled(log_path))
        after = set(api.send_many("iota", [{"n": n} for n in range(MESSAGES)]))
        wait_until(lambda: len(_handled(log_path)) > handled_at_return, RESUME_BOUND,
                   "the first message handled after the broker's return")
        resumed_after = time.monotonic() - back_at
        wait_until(lambda: before | after <= _handled(log_path), 120, "every message handled")
        alive = [p.name for p in processes if p.process.poll() is None]
    finally:
        for process in processes:
            process.signal(signal.SIGTERM)
        codes = [process.wait(60) for process in processes]
    logs = "".join(f"--- {p.name}\n{p.log()}" for p in processes)
    assert alive == [p.name for p in processes], logs
    assert codes == [0] * len(processes), logs
    for process in processes:
        assert "waiting for Kafka" in process.log() and "resumed after" in process.log(), logs
    assert waiting > 0
    done = collections.Counter(e.id for e in events(log_path) if e.event == "done")
    assert before | after <= set(done), "none lost"
    print(f"\n{backend}: the first message handled {resumed_after:.1f} s after the broker's return; "
          f"{sum(count > 1 for count in done.values())} of {len(done)} handled more than once")


def test_a_database_outage_under_an_inbox_consumer_keeps_its_effects_exactly_once(bootstrap_servers, settings,
                                                                                  database_url, tmp_path):
    """The consumer's handler writes an order per message in the inbox's transaction; Postgres goes away (every
    connection dropped, new ones refused) and comes back: the consumer keeps running, every message's order is
    written once, however often its handler ran."""
    from project.shop.models import Order

    prefix = new_prefix()
    settings.OUTBOX = {**settings.OUTBOX, "queues": queue_settings(prefix)}
    proxy, proxied = proxied_url(database_url)
    log_path = tmp_path / "events.log"
    env = process_env(proxied, bootstrap_servers, prefix, log_path)
    processes = [Process("consumer", "outbox_consume", consumer_args("kappa", "--inbox", "--workers", "2",
                                                                     handler="tests.support.queue_handlers.order"),
                         env, tmp_path),
                 Process("tracker", "outbox_redeliver", [], env, tmp_path)]
    try:
        ids = set(api.send_many("kappa", [{"n": n} for n in range(300)]))
        wait_until(lambda: len(_handled(log_path)) >= 50, 90, "50 messages handled")
        proxy.cut()
        time.sleep(5)  # the outage itself
        proxy.restore()
        wait_until(lambda: Order.objects.filter(item__in=[i[:100] for i in ids]).count() >= len(ids), 120,
                   "an order for every message")
        alive = [p.name for p in processes if p.process.poll() is None]
    finally:
        for process in processes:
            process.signal(signal.SIGTERM)
        codes = [process.wait(60) for process in processes]
        proxy.close()
    logs = "".join(f"--- {p.name}\n{p.log()}" for p in processes)
    assert alive == ["consumer", "tracker"] and codes == [0, 0], logs
    orders = collections.Counter(Order.objects.filter(item__in=[i[:100] for i in ids]).values_list("item", flat=True))
    assert len(orders) == len(ids) and set(orders.values()) == {1}, "each message's effects once"
    runs = collections.Counter(e.id for e in events(log_path) if e.event == "done")
    print(f"\n{len(ids)} messages: {sum(runs.values())} handler runs committed, every order written once")


def transaction_coordinator(cluster: Cluster, transactional_id: str) -> int:
    """The node coordinating a transactional id: the leader of its __transaction_state partition (Kafka hashes the
    id as Java's String.hashCode onto transaction.state.log.num.partitions, 50 by default)."""
    code = 0
    for char in transactional_id.encode("utf-16-be").decode("utf-16-be"):
        code = (31 * code + ord(char)) & 0xFFFFFFFF
    signed = code - (1 << 32) if code >= 1 << 31 else code
    partition = (0 if signed == -(1 << 31) else abs(signed)) % 50
    return wait_until(lambda: cluster.leaders("__transaction_state").get(partition, -1) > 0 and
                      cluster.leaders("__transaction_state")[partition], 30, "the transaction coordinator")


@pytest.fixture
def cluster(kafka_cluster: Cluster):
    kafka_cluster.heal()
    yield kafka_cluster
    kafka_cluster.heal()


@pytest.mark.slow
@pytest.mark.postgres_agnostic  # a Kafka node killed: the same on any PostgreSQL server
def test_the_consumers_transaction_coordinator_killed_on_three_brokers(cluster, settings, database_url, tmp_path):
    """SIGKILL the node coordinating the consumer's transactions (the Start markers and its offsets), mid-load on
    the three-node cluster: the consumer and the tracker keep running and every message is handled.
    Slow: the transaction coordinator moves, and the node is started again and caught up."""
    prefix = new_prefix()
    settings.OUTBOX = {**settings.OUTBOX, "base_kafka_config": cluster.client_config(),
                       "queues": queue_settings(prefix)}
    log_path = tmp_path / "events.log"
    env = {**process_env(database_url, cluster.bootstrap_servers, prefix, log_path), **cluster.environment()}
    consumer = Process("consumer", "outbox_consume", ["--queue", "lambda", "--handler",
                                                      "tests.support.queue_handlers.record", "--workers", "2"],
                       env, tmp_path)
    processes = [consumer, Process("tracker", "outbox_redeliver", [], env, tmp_path)]
    try:
        ids = set(api.send_many("lambda", [{"n": n} for n in range(1000)]))
        wait_until(lambda: len(_handled(log_path)) >= 200, 120, "200 messages handled")
        found = re.search(r"transactional id (\S+),", consumer.log())
        assert found, consumer.log()
        victim = transaction_coordinator(cluster, found[1])
        cluster.kill(victim)
        handled_at_kill = len(_handled(log_path))
        wait_until(lambda: ids <= _handled(log_path), 180, f"every message handled with node {victim} dead")
        alive = [p.name for p in processes if p.process.poll() is None]
    finally:
        for process in processes:
            process.signal(signal.SIGTERM)
        codes = [process.wait(60) for process in processes]
    logs = "".join(f"--- {p.name}\n{p.log()}" for p in processes)
    assert alive == ["consumer", "tracker"] and codes == [0, 0], logs
    print(f"\nnode {victim} (the consumer's transaction coordinator) killed after {handled_at_kill} of {len(ids)} "
          f"messages; all handled, {len(events(log_path))} handler events")
