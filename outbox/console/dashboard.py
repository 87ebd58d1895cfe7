"""What the admin dashboard shows, read with queries that stay fast on a table of millions of rows.

No COUNT(*) of the outbox and no scan by key: the backlog is counted up to 10,000 rows, then it is
Postgres's live-row estimate; what is
in flight, queued and held comes from the leaders' status rows; stuck records are looked for among
the oldest rows (the primary key's head) and through the partial index of rows that ever failed.
Every record's state is decided by outbox.states.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import connections

from outbox import conf, horizon
from outbox.harvest.replicas import Replicas, groups_without_leader, shards_without_leader
from outbox.models import OutboxRecord
from outbox.states import Count, Facts, Held, RecordState, Verdict, bounded_count, everywhere, parked_count

#: Stuck records are looked for among this many of the oldest rows (an index range, not a scan).
HEAD_ROWS = 10_000
#: At most this many stuck records are listed.
STUCK_LIMIT = 100
#: At most this many topics are listed in the backlog by topic.
TOPIC_LIMIT = 20

# Topics among the oldest HEAD_ROWS rows (a primary-key range): how many rows each, the oldest, and each
# one's share of the table in the planner's statistics of the column (from the last ANALYZE), if common.
TOPICS = """
WITH head AS (
  SELECT kafka_topic, count(*) AS n, min(create_time) AS oldest FROM (
    SELECT kafka_topic, create_time FROM {table} ORDER BY id LIMIT %(rows)s) oldest_rows
  GROUP BY kafka_topic ORDER BY n DESC, kafka_topic LIMIT %(topics)s),
shares AS (
  SELECT unnest(most_common_vals::text::text[]) AS topic, unnest(most_common_freqs) AS share FROM pg_stats
  WHERE schemaname = current_schema() AND tablename = %(table)s AND attname = 'kafka_topic')
SELECT head.kafka_topic, head.n, head.oldest, shares.share FROM head
LEFT JOIN shares ON shares.topic = head.kafka_topic ORDER BY head.n DESC, head.kafka_topic
"""


@dataclass(frozen=True)
class Alarm:
    """A red line at the top of the dashboard; `kind` names it for tests and styling."""

    kind: str
    text: str


@dataclass(frozen=True)
class Backlog:
    rows: Count
    in_flight: int
    queued: int
    oldest_created: datetime | None


@dataclass(frozen=True)
class TopicBacklog:
    """One topic's rows: exact among the oldest HEAD_ROWS rows; `estimate` of all its rows on a bigger outbox."""

    topic: str
    rows: int
    oldest_created: datetime
    estimate: int | None = None


@dataclass(frozen=True)
class OtherOutbox:
    """An outbox table other than the console's whose engines write their status rows here (a process
    harvesting many outboxes, outbox/many.py): one line of the dashboard each."""

    table: str
    groups: list[str]
    leaders: list[str]
    standbys: int
    throughput: float
    published: int


def other_outboxes(found: Replicas) -> list[OtherOutbox]:
    """The other outboxes harvested by live replicas, by table: who leads each (its engines' names)."""
    tables = sorted({r.harvested_table for r in found.live if not found.harvests_table(r)})
    result = []
    for table in tables:
        rows = [r for r in found.live if r.harvested_table == table]
        leaders = [r for r in found.leaders if r.harvested_table == table]
        result.append(OtherOutbox(table=table, groups=sorted({r.leader_group for r in rows}),
                                  leaders=[r.name for r in leaders],
                                  standbys=len([r for r in found.standbys if r.harvested_table == table
                                                and (r.shards or 1) == 1]),
                                  throughput=sum(r.throughput for r in leaders),
                                  published=sum(r.published for r in leaders)))
    return result


@dataclass(frozen=True)
class Overview:
    """Everything the dashboard shows, read once per page."""

    facts: Facts
    warnings: list[Alarm]
    backlog: Backlog
    held: list[Held]
    parked: Count
    stuck: list[tuple[OutboxRecord, Verdict]]
    topics: list[TopicBacklog]
    #: The other outboxes whose engines report here (many outboxes in one process).
    others: list[OtherOutbox]

    @property
    def replicas(self) -> Replicas:
        return self.facts.replicas


def overview(using: str | None = None) -> Overview:
    using = using or conf.database_alias()
    facts = Facts.read(using)
    rows = backlog(facts.replicas, using)
    everyone, unread = everywhere(facts) if using == conf.database_alias() else (facts.replicas, [])
    # Whether anything harvests here is this database's to say; the other alarms (the fence, an outbox without a
    # leader, two leaders, a shard without one) are every outbox's.
    alarms = warnings(facts.replicas)
    alarms += [alarm for alarm in warnings(everyone) if alarm.kind not in {"no-harvester", "no-leader"}
               and alarm not in alarms] + [Alarm("elsewhere", line) for line in unread]
    held_back = horizon.read(using)
    if held_back.held_back:
        alarms.append(Alarm("horizon", held_back.message()))
    return Overview(facts=facts, warnings=alarms, backlog=rows,
                    held=sorted(facts.held.values(), key=lambda h: h.id), parked=parked_count(using),
                    stuck=stuck_records(facts, using), topics=topics(rows.rows, using),
                    others=other_outboxes(everyone))


def topics(rows: Count, using: str) -> list[TopicBacklog]:
    """The backlog by topic, bounded on any outbox: counted among the oldest HEAD_ROWS rows (all of them on a
    smaller outbox); beyond, each topic's share of Postgres's row estimate, from its column statistics."""
    table = OutboxRecord._meta.db_table
    with connections[using].cursor() as cursor:
        cursor.execute(TOPICS.format(table=connections[using].ops.quote_name(table)),
                       {"table": table, "rows": HEAD_ROWS, "topics": TOPIC_LIMIT})
        head = cursor.fetchall()
    return [TopicBacklog(topic, count, oldest, None if rows.exact or share is None
                         else max(count, round(share * rows.value)))
            for topic, count, oldest, share in head]


def backlog(found: Replicas, using: str) -> Backlog:
    oldest = OutboxRecord.objects.using(using).order_by("id").values_list("create_time", flat=True).first()
    return Backlog(rows=bounded_count(OutboxRecord, using),
                   in_flight=sum(r.in_flight for r in found.own_leaders),
                   queued=sum(r.queued for r in found.own_leaders),
                   oldest_created=oldest)


def stuck_records(facts: Facts, using: str) -> list[tuple[OutboxRecord, Verdict]]:
    """Stuck rows among the oldest HEAD_ROWS and among those that ever failed, oldest first."""
    rows = OutboxRecord.objects.using(using).order_by("id").defer("kafka_value")
    stuck = facts.where(RecordState.STUCK)
    bound = list(rows.values_list("id", flat=True)[HEAD_ROWS - 1:HEAD_ROWS])
    head = rows.filter(stuck, id__lte=bound[0]) if bound else rows.filter(stuck)
    failed = rows.filter(stuck, reset_count__gt=0, reset_count__gte=facts.stuck_reset_count)
    found = {r.id: r for r in [*head[:STUCK_LIMIT], *failed[:STUCK_LIMIT]]}
    return [(r, facts.state_of(r)) for _, r in sorted(found.items())][:STUCK_LIMIT]


def _what(group: str, shard: int | None) -> str:
    return f"group {group!r}" if shard is None else f"shard {shard} of group {group!r}"


def warnings(found: Replicas) -> list[Alarm]:
    """Red lines: a replica blocked by the fence, nobody harvesting, two leaders claiming one group."""
    result = [Alarm("fence", (
        f"Two leader groups harvest one table ({r.harvested_table}): replica {r.name} leads its group "
        f"{r.leader_group} but is blocked, because {r.blocked_by or 'another replica'} holds the table's "
        f"database fence. {r.name} publishes nothing while blocked. Give every replica of this table the same "
        f"leader_topic and leader_group, or stop the group that should not harvest it (docs/operations.md, "
        f"\"The fence alarm\").")) for r in found.blocked]
    if not found.live:
        result.append(Alarm("no-harvester", "No harvester is running: nothing is being published."))
    elif not found.leaders:
        result.append(Alarm("no-leader", "No replica leads: nothing is being published (an election may be "
                                           "under way)."))
    result += [Alarm("outbox-no-leader", f"Outbox {table} has a live standby in group {group!r} and no leader: its "
                                         f"records are not published (an election may be under way).")
               for group, table in groups_without_leader(found)]
    by_group: dict[tuple[str, int | None], list[str]] = {}
    for leader in found.leaders:
        by_group.setdefault((leader.leader_group, leader.shard), []).append(leader.name)
    result += [Alarm("two-leaders", f"More than one replica claims to lead {_what(group, shard)} ({', '.join(names)}): "
                                      f"until one gives way, per-key order is at risk.")
               for (group, shard), names in by_group.items() if len(names) > 1]
    result += [Alarm("shard-no-leader", f"Group {group!r} has {shards} shards and no live replica leads shard"
                                        f"{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}: their keys "
                                        f"are not published (a hand-off may be under way; docs/scaling.md)")
               for group, shards, missing in shards_without_leader(found)]
    return result
