"""Sharded harvesting against real Postgres and Kafka (outbox/harvest/shards.py, sharding.py).

- The shard of a key is the same in Python and in Postgres, and a shard's mark reads through its index.
- Two replicas with 4 shards share the work (both lead shards at once), every record arrives, in order.
- A replica leaving hands its shards over: the other takes them, nothing is lost or reordered.
- A replica whose N differs from its group's, or a group sharded differently on the same table, cannot
  publish beside it.
"""

from __future__ import annotations

import io
import re
import signal
import threading
import time
import uuid

import psycopg
import pytest
from psycopg import sql

from outbox.console.dashboard import warnings
from outbox.harvest import contract, sharding
from outbox.harvest.config import HarvestConfig, Limits
from outbox.harvest.harvester import Harvester, HarvestError
from outbox.harvest.replicas import Replicas
from outbox.harvest.replicas import read as replicas_read
from outbox.harvest.shard_index import ensure_shard_index
from outbox.harvest.shards import ShardedHarvester
from outbox.harvest.store import PostgresStore, connect
from outbox.models import ShardTerm
from tests.support.harness import (
    Generator,
    Replica,
    TopicTail,
    assert_complete_and_ordered,
    outbox_count,
    read_topic,
    replica_env,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def config(group: str, name: str, database_url: str, bootstrap: str, shards: int) -> HarvestConfig:
    return HarvestConfig(dsn=database_url, base_kafka_config={"bootstrap.servers": bootstrap}, leader_topic=group,
                         leader_group=group, name=name, shards=shards,
                         limits=Limits(heartbeat_timeout=2.0, status_interval=0.3))


def test_the_shard_of_a_key_is_the_same_in_python_and_in_postgres(database_url):
    keys = ["", "a", "order-42", "héllo wörld", "🙂" * 10, "x" * 1000, *[f"key-{i}" for i in range(200)]]
    with psycopg.connect(database_url) as conn:
        for shards in (2, 3, 7, 256):
            rows = conn.execute(f"SELECT k, {sharding.shard_expression(shards, 'k')} FROM unnest(%s::text[]) AS k",
                                [keys]).fetchall()
            assert {key: shard for key, shard in rows} == {key: sharding.shard_of(key, shards) for key in keys}


def test_replicas_that_start_together_build_the_shard_index_once(database_url):
    """Replicas of a new N start at once (a deployment's rollout): each wants the index, one builds it, none fails.

    Before, each built it at once: CREATE INDEX CONCURRENTLY of one name in several sessions failed with
    "tuple concurrently updated" or "deadlock detected", and a replica could drop another's index while
    it was being built, taking it for an interrupted build.
    """
    shards = 5  # a count no other test builds
    with connect(database_url, "setup") as conn:
        conn.execute(f"DROP INDEX IF EXISTS {sharding.index_name('outbox', shards)}")
        conn.execute("INSERT INTO outbox (kafka_topic, kafka_key, kafka_value) "
                     "SELECT 't', 'k' || (i % 100), 'v' FROM generate_series(1, 20000) AS i")
    replicas = 4
    start = threading.Barrier(replicas)
    failures: list[BaseException] = []

    def replica() -> None:
        start.wait()
        try:
            ensure_shard_index(database_url, "outbox", shards)
        except BaseException as error:  # every failure is the test's finding
            failures.append(error)

    threads = [threading.Thread(target=replica) for _ in range(replicas)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not [thread for thread in threads if thread.is_alive()], "a replica still waits after 60 s"
        assert not failures, [str(error) for error in failures]
        with connect(database_url, "check") as conn:
            valid = conn.execute("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)",
                                 [sharding.index_name("outbox", shards)]).fetchall()
        assert valid == [(True,)], valid
    finally:
        with connect(database_url, "setup") as conn:
            conn.execute(f"DROP INDEX IF EXISTS {sharding.index_name('outbox', shards)}")


def explain_prepared(conn: psycopg.Connection, statement: sql.Composable, params: dict[str, object]) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of `statement` run as the engine runs it: prepared, on a session planning it
    once for any parameters (a generic plan, whose conditions name $1, $2, ... instead of values)."""
    text = statement.as_string(conn)
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", text)))
    for number, name in enumerate(names, 1):
        text = text.replace(f"%({name})s", f"${number}")
    conn.execute(f"PREPARE explained AS {text}")
    try:
        values = sql.SQL(", ").join(sql.Literal(params[name]) for name in names)  # EXPLAIN takes no parameters
        return "\n".join(row[0] for row in conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, BUFFERS) EXECUTE explained({})").format(values)))
    finally:
        conn.execute("DEALLOCATE explained")


def test_a_shards_mark_reads_its_own_rows_through_its_index(database_url):
    ensure_shard_index(database_url, "outbox", 4)
    with connect(database_url, "explain", generic_plans=True) as conn:  # a session as the engine's fence session
        conn.execute("DELETE FROM outbox")
        mark = sql.SQL(contract.MARK).format(table=sql.Identifier("outbox"), above=sql.SQL(contract.mark_above(4)))
        gaps = sql.SQL(contract.shard_gaps(4)).format(table=sql.Identifier("outbox"))
        # A plan made on the table analyzed empty (as after a drain) still reads through the indexes.
        conn.execute("VACUUM ANALYZE outbox")
        plan = explain_prepared(conn, mark, {"after": 0, "shard": 1, "limit": 1000})
        assert sharding.index_name("outbox", 4) in plan and "Seq Scan" not in plan, plan
        plan = explain_prepared(conn, gaps, {"los": [1], "his": [5], "shard": 1, "limit": 1000})
        assert "Seq Scan" not in plan, plan
        conn.execute("INSERT INTO outbox (kafka_topic, kafka_key, kafka_value) "
                     "SELECT 't', 'k' || (i % 100), 'v' FROM generate_series(1, 20000) AS i")
        conn.execute("ANALYZE outbox")
        first = conn.execute("SELECT min(id) FROM outbox").fetchone()[0]
        for after in (0, first + 10_000, first + 19_990):  # a mark from the head, from the middle, near the end
            plan = explain_prepared(conn, mark, {"after": after, "shard": 1, "limit": 1000})
            assert sharding.index_name("outbox", 4) in plan and "outbox_pkey" not in plan, plan
            assert "$2" in plan, f"a generic plan: {plan}"
            # It starts at `after` in the shard's index: a 1000-row mark reads its rows' pages, not the shard's.
            assert int(re.search(r"Buffers: shared hit=(\d+)", plan).group(1)) < 200, plan
        # Each gap's lookup reads the gap's ids only (by either index), not the rest of the table or the shard.
        los, his = list(range(first + 10_000, first + 12_000, 10)), list(range(first + 10_005, first + 12_005, 10))
        plan = explain_prepared(conn, gaps, {"los": los, "his": his, "shard": 1, "limit": 1000})
        assert "Seq Scan" not in plan and "$" in plan, plan
        buffers = int(re.search(r"Buffers: shared hit=(\d+)", plan).group(1))
        assert buffers < 8 * len(los), plan  # a descent and the gap's few rows, per gap
        assert "JIT" not in plan, "the engine's sessions run without JIT (its cost estimates are no guide here)"
    store = PostgresStore.open(database_url, "outbox", name="t", group="g", shards=4, shard=1)
    try:
        assert store.take_fence() is None
        records, _ = store.mark(1000, 0)
    finally:
        store.close()
    assert len(records) == 1000 and {sharding.shard_of(r.key, 4) for r in records} == {1}
    assert [r.id for r in records] == sorted(r.id for r in records)


def test_two_replicas_share_the_shards_and_every_record_arrives_in_order(database_url, bootstrap_servers, new_topic,
                                                                         caplog):
    topic = new_topic("shards")
    group = f"shards-{uuid.uuid4().hex[:8]}"
    first = ShardedHarvester(config(group, "replica-a", database_url, bootstrap_servers, 4))
    second = ShardedHarvester(config(group, "replica-b", database_url, bootstrap_servers, 4))
    generator = Generator(topic, keys=100, pause=0.005)
    first.start()
    try:
        wait_until(lambda: len(first.leading_shards) == 4, 60, "replica a to lead all four shards")
        generator.start()
        wait_until(lambda: len(generator.ids) >= 1000, 60, "1000 records stashed")
        second.start()
        wait_until(lambda: first.leading_shards and second.leading_shards
                   and len(first.leading_shards) + len(second.leading_shards) == 4, 60,
                   "the shards spread over both replicas")
        assert not set(first.leading_shards) & set(second.leading_shards)
        wait_until(lambda: len(generator.ids) >= 3000, 60, "2000 more records stashed")
        first.stop()  # its shards move to replica b once they settled
        first.wait(timeout=60)
        wait_until(lambda: len(second.leading_shards) == 4, 60, "replica b to lead every shard")
        # Each shard's row says who leads it now: replica b, or replica a before it let go settled.
        terms = {shard: (holder, settled) for shard, holder, settled in ShardTerm.objects.filter(
            shards=4).values_list("shard", "holder", "settled")}
        assert sorted(terms) == [0, 1, 2, 3] and all(h.startswith("replica-b-s") and not ok for h, ok in terms.values())
        assert "did not settle" not in caplog.text, "a graceful hand-off needs no wait for stragglers"
        wait_until(lambda: len(generator.ids) >= 4000, 60, "1000 more records stashed")
        stashed = generator.stop()
        wait_until(lambda: outbox_count(database_url) == 0, 60, "the outbox to drain")
    finally:
        generator.halt.set()
        for harvester in (first, second):
            harvester.stop()
            harvester.wait(timeout=60)
    audit = read_topic(bootstrap_servers, topic, expected=len(stashed))
    assert_complete_and_ordered(audit, stashed)


def test_a_replica_with_another_number_of_shards_refuses_to_start(database_url, bootstrap_servers):
    group = f"shards-{uuid.uuid4().hex[:8]}"
    first = ShardedHarvester(config(group, "replica-a", database_url, bootstrap_servers, 3))
    first.start()
    try:
        with pytest.raises(HarvestError, match=r"has 3 partition\(s\).*runs 2 shard\(s\)"):
            ShardedHarvester(config(group, "replica-b", database_url, bootstrap_servers, 2)).start()
        unsharded = Harvester(config(group, "replica-c", database_url, bootstrap_servers, 1))
        with pytest.raises(HarvestError, match=r"has 3 partition\(s\).*runs 1 shard\(s\)"):
            unsharded.start()
    finally:
        first.stop()
        first.wait(timeout=60)


def test_groups_sharded_differently_on_one_table_never_lead_at_once(database_url, bootstrap_servers):
    suffix = uuid.uuid4().hex[:8]
    three = ShardedHarvester(config(f"three-{suffix}", "replica-3", database_url, bootstrap_servers, 3))
    two = ShardedHarvester(config(f"two-{suffix}", "replica-2", database_url, bootstrap_servers, 2))
    unsharded = Harvester(config(f"one-{suffix}", "replica-1", database_url, bootstrap_servers, 1))
    three.start()
    try:
        wait_until(lambda: len(three.leading_shards) == 3, 60, "the three-shard group to lead")
        two.start()
        unsharded.start()
        wait_until(lambda: two.engines and all(e.replica_state.value == "blocked" for e in two.engines.values())
                   and len(two.engines) == 2, 60, "the two-shard group's engines to be blocked")
        wait_until(lambda: unsharded.replica_state.value == "blocked", 60, "the unsharded leader to be blocked")
        assert len(three.leading_shards) == 3 and not two.leading_shards and not unsharded.is_leader
        three.stop()
        three.wait(timeout=60)
        wait_until(lambda: len(two.leading_shards) == 2 or unsharded.is_leader, 60,
                   "another group to lead once the first let go")
        assert not (two.leading_shards and unsharded.is_leader)
    finally:
        for harvester in (three, two, unsharded):
            harvester.stop()
            harvester.wait(timeout=60)


def engine_rows(database_url: str) -> list[tuple[str, int, object, int]]:
    """(name, shard, leader id, published) of the shard engines leading now, by their fresh status rows."""
    with psycopg.connect(database_url) as conn:
        return conn.execute("SELECT name, shard, leader_id, published FROM outbox_harvester WHERE shard IS NOT NULL "
                            "AND state = 'leader' AND leader_id IS NOT NULL AND last_seen > now() - interval '2 s' "
                            "ORDER BY shard").fetchall()


def replicas_leading(database_url: str) -> dict[str, set[int]]:
    found: dict[str, set[int]] = {}
    for name, shard, _, _ in engine_rows(database_url):
        found.setdefault(sharding.replica_of(name, shard), set()).add(shard)
    return found


@pytest.mark.slow
def test_a_killed_replicas_shards_move_and_the_others_keep_publishing(database_url, bootstrap_servers, new_topic,
                                                                       tmp_path):
    """Three replicas, six shards, a steady writer; SIGKILL one replica. Its shards stop until Kafka's session
    timeout gives them to the others; the other shards never stop. Nothing is lost or reordered.
    Slow: Kafka's session timeout, then a rebalance of six shards."""
    topic = new_topic("shards-kill")
    group = f"test-shards-{uuid.uuid4().hex[:8]}"
    env = replica_env(database_url, bootstrap_servers, group)
    args = ["--shards", "6", "--heartbeat-timeout", "2"]
    replicas = [Replica(f"replica-{i}", env, tmp_path, args) for i in range(3)]
    generator = Generator(topic, keys=60, pause=0.005)
    tail = TopicTail(bootstrap_servers, topic)
    try:
        wait_until(lambda: len(replicas_leading(database_url)) == 3
                   and sum(map(len, replicas_leading(database_url).values())) == 6, 90,
                   "six shards led, spread over the three replicas")
        tail.start()
        generator.start()
        wait_until(lambda: len(generator.ids) >= 2000, 60, "2000 records stashed")
        before = {name: published for name, _, _, published in engine_rows(database_url)}
        wait_until(lambda: len(generator.ids) >= 4000, 60, "2000 more records stashed")
        rows = engine_rows(database_url)
        # The work is spread: every replica's engines published records of the last 2000, under their own ids.
        publishing = {sharding.replica_of(name, shard) for name, shard, _, published in rows
                      if published > before.get(name, 0)}
        assert len(publishing) == 3 and len({leader_id for _, _, leader_id, _ in rows}) == 6, rows
        victim = replicas[0]
        victims_shards = replicas_leading(database_url)[victim.name]
        killed_at, written_before = time.time(), max(generator.ids)
        victim.kill()
        time.sleep(7)
        written_by = max(generator.ids)
        arrived = {record_id for when, record_id in list(tail.arrivals) if when <= killed_at + 7}
        window = [i for i in generator.ids if written_before < i <= written_by]
        delivered = sum(1 for i in window if i in arrived) / len(window)
        print(f"\nSIGKILL of a replica leading shards {sorted(victims_shards)} of 6: {delivered:.0%} of the "
              f"{len(window)} records written in the next 7 s were delivered within them")
        assert delivered >= 0.4, f"only {delivered:.0%} of the records written in the 7 s after the kill arrived"
        wait_until(lambda: sum(map(len, replicas_leading(database_url).values())) == 6
                   and victim.name not in replicas_leading(database_url), 60, "the survivors to lead all six shards")
        # As harvest_health and the dashboard read the rows: the victim wrote no last row, and its engines' rows are
        # gone once their successors' say they lead (not two leaders of a shard until status_gone_after).
        with psycopg.connect(database_url) as conn:
            rows, now = replicas_read(conn, "outbox_harvester")
        found = Replicas.sort([r for r in rows if r.leader_group == group], now, 20.0)
        assert {r.shard for r in found.superseded} == victims_shards, found.superseded
        assert sorted(r.shard for r in found.leaders if r.shard is not None) == list(range(6)), found.leaders
        assert not [alarm for alarm in warnings(found) if alarm.kind == "two-leaders"], warnings(found)
        # The victim's fences went with its sessions, unsettled: its successors waited for its stragglers.
        waited = "".join(replica.log() for replica in replicas[1:]).count("which did not settle")
        assert waited == len(victims_shards), f"{waited} waits for {len(victims_shards)} shards taken over"
        stashed = generator.stop()
        wait_until(lambda: outbox_count(database_url) == 0, 60, "the outbox to drain")
        wait_until(lambda: tail.has(stashed), 60, "every record to arrive")
    finally:
        generator.halt.set()
        for replica in replicas:
            replica.signal(signal.SIGTERM)
        for replica in replicas:
            replica.wait(timeout=60)
    assert_complete_and_ordered(tail.stop(), stashed)


def test_resharding_waits_for_the_group_to_stop_then_changes_the_topic_and_the_index(database_url,
                                                                                     bootstrap_servers, new_topic):
    from django.core.management import CommandError, call_command

    topic = new_topic("reshard")
    group = f"reshard-{uuid.uuid4().hex[:8]}"
    two = ShardedHarvester(config(group, "replica-a", database_url, bootstrap_servers, 2))
    two.start()
    try:
        wait_until(lambda: len(two.leading_shards) == 2, 60, "the two-shard group to lead")
        with pytest.raises(CommandError, match=r"a harvester leads on 'outbox' \(outbox-harvest-fence .*replica-a-s"):
            call_command("outbox_reshard", "--shards", "3", "--leader-topic", group)
    finally:
        two.stop()
        two.wait(timeout=60)
    out = io.StringIO()
    call_command("outbox_reshard", "--shards", "3", "--leader-topic", group, stdout=out)
    said = out.getvalue()  # the other tests' indexes (other Ns) go too
    assert f"leader topic {group!r} grown from 2 to 3 partition(s); index outbox_shard3_idx ready; dropped " in said
    assert "outbox_shard2_idx" in said.split("dropped")[1], said
    three = ShardedHarvester(config(group, "replica-a", database_url, bootstrap_servers, 3))
    generator = Generator(topic, keys=30, pause=0.005, limit=1000)
    three.start()
    try:
        wait_until(lambda: len(three.leading_shards) == 3, 60, "the three-shard group to lead")
        generator.start()
        generator.join(60)  # it stops by itself after 1000 records
        stashed = generator.stop()
        wait_until(lambda: outbox_count(database_url) == 0, 60, "the outbox to drain")
    finally:
        three.stop()
        three.wait(timeout=60)
    assert_complete_and_ordered(read_topic(bootstrap_servers, topic, expected=len(stashed)), stashed)
    out = io.StringIO()
    call_command("outbox_reshard", "--shards", "1", "--leader-topic", group, stdout=out)
    said = out.getvalue()
    assert f"leader topic {group!r} made again with 1 partition(s); no shard index needed; dropped " in said
    assert "outbox_shard3_idx" in said.split("dropped")[1], said
    unsharded = Harvester(config(group, "replica-a", database_url, bootstrap_servers, 1))
    unsharded.start()
    try:
        wait_until(lambda: unsharded.is_leader, 60, "the unsharded replica to lead")
    finally:
        unsharded.stop()
        unsharded.wait(timeout=60)
