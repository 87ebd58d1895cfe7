"""Deliberate bugs, to show the simulator has teeth: for each, some seed must fail.

    python -m tests.sim.mutations            # for each bug, the first seeds that catch it
    python -m tests.sim.mutations --check    # only the seeds listed in CAUGHT_BY (what CI runs)
    python -m tests.sim.mutations --queue    # the queue's only (--only TEXT: those whose name has TEXT)
    python -m tests.sim.mutations --shards   # the shards' only
    python -m tests.sim.mutations --share    # the share backend's only
    python -m tests.sim.mutations --many     # the many-outboxes process's only

Each mutation is a small change to the real core or driver (a subclass) or to the simulated table's
SQL; the runs use one record per key in flight, goharvest's mode, where the stricter order applies.
The queue's mutations (tests/sim/queue_mutations.py) run in the queue's simulator, the shards'
(SHARD_MUTATIONS) in the sharded runs (tests/sim/shard_scenario.py), the share backend's
(tests/sim/share_mutations.py) in the share queue's runs (tests/sim/share_scenario.py), the many-outboxes
process's (MANY_MUTATIONS) in its runs (tests/sim/many_scenario.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from operator import methodcaller
from typing import Any

from outbox.harvest import commands as cmd
from outbox.harvest import sharding
from outbox.harvest.core import Core
from outbox.harvest.driver import Driver
from outbox.harvest.lanes import EntryState, Lane, Lanes
from outbox.harvest.leadership import Leadership
from outbox.harvest.marking import Marking
from outbox.harvest.memory_table import MemoryTable, Row, Session
from outbox.harvest.neli import ElectionPoll
from outbox.harvest.outboxes import ManyHarvester
from outbox.harvest.settling import Settling
from outbox.harvest.supervisor import Slot, Supervisor
from outbox.kafka.sizes import UNLIMITED
from tests.sim import many_scenario, queue_scenario, shard_scenario, share_scenario
from tests.sim.many_scenario import ManyOptions
from tests.sim.queue_mutations import QUEUE_MUTATIONS
from tests.sim.replay import quiet
from tests.sim.scenario import Options, run
from tests.sim.shard_scenario import ShardOptions
from tests.sim.share_mutations import SHARE_MUTATIONS

# -- the core's parts -------------------------------------------------------------------------

class BarrierOnAck(Lanes):
    """Frees a key's slot when Kafka acknowledges its record, not when the purge has committed."""

    def slots(self, lane: Lane) -> int:
        busy = sum(1 for entry in lane.unsettled if entry.state is not EntryState.ACKED)
        return (1 if lane.single or lane.retrying else self.limits.max_in_flight_per_key) - busy


class KeysPipelinedFromTheStart(Lanes):
    """Sends a key's records together from its first one to a topic, on a new producer too (lanes.py)."""

    def slots(self, lane: Lane) -> int:
        return (1 if lane.single or lane.retrying else self.limits.max_in_flight_per_key) - len(lane.unsettled)


class PurgesNeverDurable(Settling):
    """Lets every purge commit asynchronously, with one record per key in flight too: a key's next
    record goes out on a purge that a crash of the database can still undo (R0 R1 R0)."""

    def purges_durable(self) -> bool:
        return False


class FenceSeenByAMarkBeforeAWaitedPurge(Settling):
    """Skips the fence's read after a mark also when the purge frees what waits to be sent: the next
    send may then follow a purge that ran after the fence was lost (the mark ran before)."""

    def purge_reads_fence(self, settle_wanted: bool) -> bool:
        return not self.mark_saw_fence


class PurgesNeverReadTheFence(Settling):
    """No purge or reset reads the fence."""

    def flush(self, now: float, fenced: bool, active: bool, settle_wanted: bool) -> list[cmd.Command]:
        return super().flush(now, False, active, settle_wanted)


def settling(part: type[Settling]) -> type[Lanes]:
    """Lanes whose purge and reset batches are the given mutant."""
    return type(f"LanesWith{part.__name__}", (Lanes,), {"settling_class": part})


class ReusedLeaderId(Leadership):
    """Keeps its leader id when it refreshes after a failure."""

    def _begin_term(self) -> None:
        previous = getattr(self, "_last_leader_id", None)
        super()._begin_term()
        if previous is not None:
            self.leader_id = previous
            self.core._commands[-1] = cmd.TakeFence(previous)
        self._last_leader_id = self.leader_id


class NoHeartbeatFence(Leadership):
    """Goes on sending when it no longer sees its own heartbeats."""

    def tick(self, now: float) -> None:
        self._heartbeat_seen_at = max(self._heartbeat_seen_at, now)
        super().tick(now)


class ResendBeforeRefresh(Leadership):
    """After a failed delivery, resets the row and carries on under the same leader id."""

    def remark(self) -> None:
        if self.force_remark or self.core.lanes.settling.to_reset:  # the failed-delivery path: skip the re-mark
            self.force_remark = False
            return
        super().remark()


class ReleaseAtOnce(Leadership):
    """Lets partition 0 go as soon as it is revoked, without waiting for what is in flight to settle."""

    def on_revoked(self) -> None:
        super().on_revoked()
        if self._release_at is not None:
            self._release_at = None
            self.core.command(cmd.ReleasePartition())


class GapsNotKept(Marking):
    """Reads on from the highest id read, forgetting the ids below it that were not visible yet."""

    def _record_gaps(self, after: int, rows: list[Any]) -> None:
        pass


class GapsForgottenEarly(Marking):
    """Forgets a gap the first time a lookup does not find it, without waiting for its writers to end."""

    def _resolve(self, looked: tuple[tuple[int, int], ...], found: list[Any], upto: int,
                 writers: frozenset[str]) -> None:
        for gap in self.gaps:
            gap.watch, gap.watched_at = frozenset(), -1
        super()._resolve(looked, found, upto, frozenset())


# -- shards: the hand-off through the fence (leadership.py) and the shard's reads -----------------

class ShardFenceLetGoAtOnce(Leadership):
    """A shard's engine lets its fence go as soon as its term ends, with records still in flight (no
    `_fence_release_owed`): its successor may mark before they land."""

    def _end_term(self, event: Any, *, abort: bool) -> None:
        super()._end_term(event, abort=abort)
        if self._fence_release_owed:
            self._fence_release_owed = False
            self.core.command(cmd.ReleaseFence())


class UnsettledPredecessorIgnored(Leadership):
    """A shard's next leader marks at once after taking a fence whose previous holder did not settle (its
    session ended with records in flight): the shard terms row is not read."""

    def on_fence(self, leader_id: Any, taken: bool, holder: str | None, same_group: bool = False,
                 unsettled: str | None = None) -> None:
        super().on_fence(leader_id, taken, holder, same_group, None)


class UnfilteredShardMark(MemoryTable):
    """A shard's mark (and its gap lookups) read every shard's rows: contract.reads() without the shard."""

    @staticmethod
    def in_shard(row: Row, session: Session) -> bool:
        return True


def with_part(**parts: type) -> Callable[..., Core]:
    """A core factory whose parts include the given mutants (leadership_class=..., lanes_class=...)."""
    mutant = type("MutantCore", (Core,), {f"{name}_class": part for name, part in parts.items()})
    return lambda *args, **kwargs: mutant(*args, **kwargs)


# -- the election thread's step (neli.ElectionPoll) --------------------------------------------------

class RevokeLetGoAtOnce(ElectionPoll):
    """The revoke callback tells the core and returns at once: Kafka hands partition 0 on while the core still has
    records in flight."""

    def _revoked(self) -> None:
        self._post(methodcaller("on_revoked"))


class EveryPollTakenForAHeartbeat(ElectionPoll):
    """Tells the core each poll saw its own heartbeat, whether or not one came back."""

    def step(self) -> None:
        self.election.poll(heartbeat=self.heartbeat)
        self._post(lambda core: core.on_polled(True))


# -- the driver ---------------------------------------------------------------------------------

class MarkErrorTakenAsEmpty(Driver):
    """Takes a failed mark for one that found nothing, so its term goes on (on a session that may have
    lost the fence) instead of starting again."""

    def _mark(self, command: cmd.Mark) -> None:
        self._run("fence", lambda store: store.mark(command.limit, command.after, command.gaps),
                  lambda core, result: core.on_marked(command, *result),
                  lambda core, error: core.on_marked(command, [], frozenset()))


class SendsPastARefusal(Driver):
    """When produce() refuses a record, goes on producing the later records of its key in the same Send."""

    def _send(self, command: cmd.Send) -> None:
        for record in command.records:
            super()._send(dataclasses.replace(command, records=(record,)))


class RestartForgetsInFlight(Driver):
    """After replacing the record producer, drops the delivery reports of the producer it replaced."""

    generation = 0

    def _restart_producer(self, command: cmd.RestartProducer) -> None:
        self.generation += 1
        super()._restart_producer(command)

    def _send(self, command: cmd.Send) -> None:
        sent_in = self.generation
        super()._send(command)
        self._sent_in = getattr(self, "_sent_in", {})
        for record in command.records:
            self._sent_in[record.id] = sent_in

    def delivered(self, record_id: int, error: Any) -> None:
        if getattr(self, "_sent_in", {}).get(record_id, self.generation) < self.generation:
            return  # "that producer is gone": its reports are ignored
        super().delivered(record_id, error)


class IgnoresTopicLimits(Driver):
    """Produces without asking for the topics' max.message.bytes (as before it was learned)."""

    def _send(self, command: cmd.Send) -> None:
        io = self.io
        asked = io.topic_limit
        io.topic_limit = lambda _topic: UNLIMITED
        try:
            super()._send(command)
        finally:
            io.topic_limit = asked


class BatchesNotFitted(Driver):
    """Knows the topics' limits, but keeps the producer's batch size (holds only records too big alone)."""

    def _send(self, command: cmd.Send) -> None:
        io = self.io
        fit = io.fit_batches
        io.fit_batches = lambda _limit: True
        try:
            super()._send(command)
        finally:
            io.fit_batches = fit


class TrustsEveryAck(Driver):
    """Takes every report of delivery for one, even at an offset already written (acks.py)."""

    def _not_delivered(self, acks: Any, message: Any) -> None:
        return None


MUTATIONS: dict[str, Options] = {
    "barrier lowered on the ack instead of after the purge": Options(core_factory=with_part(lanes=BarrierOnAck),
                                                                     per_key=1),
    "a leader id reused": Options(core_factory=with_part(leadership=ReusedLeaderId), per_key=1),
    # A purge reads the fence unless a mark saw it since the last purge (Settling.flush). What the
    # reads add shows where a leader does not fence itself on missing heartbeats: then the database
    # fence alone must stop it (tests/unit/test_simulation.py runs that with the real lanes).
    "purges and resets never read the fence, no heartbeat fence": Options(
        core_factory=with_part(leadership=NoHeartbeatFence, lanes=settling(PurgesNeverReadTheFence)), per_key=1,
        db_fence=True),
    "a purge something waits on not reading the fence after a mark, no heartbeat fence": Options(
        core_factory=with_part(leadership=NoHeartbeatFence, lanes=settling(FenceSeenByAMarkBeforeAWaitedPurge)),
        per_key=1, db_fence=True),
    # The database fence stops a stale leader too; without it (PgBouncer in transaction mode) only
    # the heartbeat fence does.
    "no fencing on missing heartbeats": Options(core_factory=with_part(leadership=NoHeartbeatFence), per_key=1,
                                                db_fence=False),
    "ids not yet visible skipped (no gaps kept)": Options(core_factory=with_part(marking=GapsNotKept), per_key=1),
    "a gap forgotten before its writers ended": Options(core_factory=with_part(marking=GapsForgottenEarly),
                                                        per_key=1),
    "a failed record resent before the refresh": Options(core_factory=with_part(leadership=ResendBeforeRefresh),
                                                         per_key=1),
    # The loop (driver.py) and what moved into the core from it.
    "settling skipped on revoke": Options(core_factory=with_part(leadership=ReleaseAtOnce), per_key=1),
    # The election thread's step, as the process runs it (neli.ElectionPoll).
    "the revoke callback returns before the core released partition 0": Options(
        election_poll_class=RevokeLetGoAtOnce, per_key=1),
    "every election poll taken for one that saw its own heartbeat, no database fence": Options(
        election_poll_class=EveryPollTakenForAHeartbeat, per_key=1, db_fence=False),
    "a mark error taken as a mark that found nothing": Options(driver_factory=MarkErrorTakenAsEmpty, per_key=1),
    "records sent past a refused record of their key": Options(driver_factory=SendsPastARefusal, per_key=4),
    # Several per key in flight: a refused batch is fatal there, so producers are replaced often.
    "a producer restart that forgets what was in flight": Options(driver_factory=RestartForgetsInFlight, per_key=4),
    # A topic with a small max.message.bytes (topics.py): batches that do not fit it are refused whole.
    "records produced without reading the topic's limit": Options(driver_factory=IgnoresTopicLimits, per_key=4,
                                                                  topic_limits=True),
    "batches not fitted to the topic's limit": Options(driver_factory=BatchesNotFitted, per_key=4,
                                                       topic_limits=True),
    # A partition takes a producer's first batch whatever its sequence (memory/broker.py): a key's second
    # record sent beside its first can be written first when the first fails for a moment.
    "a key's first records sent together (on a new producer)": Options(
        core_factory=with_part(lanes=KeysPipelinedFromTheStart), per_key=4),
    # Producers that number records from 0 again (their state of a partition lost): Kafka acknowledges
    # those as duplicates of what it wrote first, and writes nothing.
    "an acknowledgement at an offset already written taken for delivery": Options(
        driver_factory=TrustsEveryAck, per_key=1, lost_sequences=True),
    # A database that crashes now and then undoes the purges that committed asynchronously and were
    # not flushed yet (MemoryTable.restart): with one record per key in flight, a purge must be durable.
    "purges committed asynchronously with one record per key in flight": Options(
        core_factory=with_part(lanes=settling(PurgesNeverDurable)), per_key=1, db_restarts=True),
}

def moved_shard_kept(shard: int, owned: set[int], election: Any) -> bool:
    """The manager stops an engine only when its shard is revoked and assigned back at once: one whose shard
    moved to another replica keeps running."""
    return election is not None and election.gone and shard in owned


def revoke_ignored(shard: int, owned: set[int], election: Any) -> bool:
    """Retires an engine only when its shard is no longer the replica's: one whose shard was revoked and assigned
    straight back keeps running, its term ended by the revoke, and nobody leads the shard (a fresh engine should
    take the new assignment)."""
    return shard not in owned


class RestartedAtOnce(Supervisor[Any, Any]):
    """Starts a failed engine again at the next reconcile, without the backoff."""

    def _failed(self, key: Any, slot: Slot[Any], now: float, why: str) -> None:
        super()._failed(key, slot, now, why)
        slot.retry_at = now


class NeverRestarted(Supervisor[Any, Any]):
    """Forgets to start a failed engine again: its shard stays assigned to the replica, and nobody leads it."""

    def _failed(self, key: Any, slot: Slot[Any], now: float, why: str) -> None:
        super()._failed(key, slot, now, why)
        slot.retry_at = math.inf


class EndsBeforeSettled(Supervisor[Any, Any]):
    """A stopping replica's end asks every engine to stop and ends at once, without waiting for them to settle:
    its consumer leaves the group while its engines still publish."""

    def settle_all(self) -> bool:
        super().settle_all()
        return True


def credited_to_one(engines: list[Any]) -> list[tuple[str, list[Any]]]:
    """replicas._by_replica as harvest_health first had it: every leading engine's shard credited to the replica
    of the first row."""
    rows = sorted(engines, key=lambda r: (r.leader_group, r.shard))
    return [(sharding.replica_of(rows[0].name, rows[0].shard), rows)] if rows else []


class DroppedOutboxKept(ManyHarvester):
    """Retires an engine only when its outbox changed, not when discovery no longer finds it: a dropped tenant's
    engine keeps running, and its fence."""

    def wanted(self, now: float) -> dict[str, Any]:
        return {**{label: engine.config for label, engine in self.engines.items()}, **super().wanted(now)}

    def retires(self, label: str, engine: Any) -> bool:
        with self._lock:
            found = self._wanted.get(label)
        return found is not None and found != engine.config


class DiscoveryFailureDropsAll(ManyHarvester):
    """Takes a failed discovery for one that found nothing: every engine stops while the catalog is away."""

    def _rescan(self) -> None:
        try:
            self._discover()
        except Exception:
            with self._lock:
                self._wanted = {}
            return
        super()._rescan()


#: Many outboxes in one process (tests/sim/many_scenario.py).
MANY_MUTATIONS: dict[str, ManyOptions] = {
    "a dropped outbox's engine kept running": ManyOptions(harvester_class=DroppedOutboxKept),
    "a failed discovery taken for no outbox at all": ManyOptions(harvester_class=DiscoveryFailureDropsAll),
    "a failed outbox engine started again at once": ManyOptions(supervisor_class=RestartedAtOnce),
}


SHARD_MUTATIONS: dict[str, ShardOptions] = {
    "a status report that credits one replica with another's shards": ShardOptions(
        patches={"outbox.harvest.replicas._by_replica": credited_to_one}),
    "an engine whose shard moved keeps running": ShardOptions(
        patches={"outbox.harvest.shards.retires": moved_shard_kept}),
    "an engine kept through a revoke of its shard that came straight back": ShardOptions(
        patches={"outbox.harvest.shards.retires": revoke_ignored}),
    "a failed engine started again at once, without a backoff": ShardOptions(supervisor_class=RestartedAtOnce),
    "a stopping replica leaves its group before its engines settled": ShardOptions(
        supervisor_class=EndsBeforeSettled),
    "a failed engine never started again": ShardOptions(supervisor_class=NeverRestarted),
    "a shard's fence let go at once when its term ends": ShardOptions(
        core_factory=with_part(leadership=ShardFenceLetGoAtOnce)),
    "a shard's mark reads every shard's rows": ShardOptions(table_factory=UnfilteredShardMark),
    "a shard taken from a leader that did not settle, at once": ShardOptions(
        core_factory=with_part(leadership=UnsettledPredecessorIgnored)),
}

#: Seeds that catch each mutation, as `python -m tests.sim.mutations` found them. A change to the
#: simulator or the core can change which seeds catch what: run it again and update this list
#: (and docs/simulation.md).
CAUGHT_BY: dict[str, list[int]] = {
    "barrier lowered on the ack instead of after the purge": [1, 2, 3],
    "a leader id reused": [1, 2, 3],
    "purges and resets never read the fence, no heartbeat fence": [199, 545, 1907],
    "a purge something waits on not reading the fence after a mark, no heartbeat fence": [1529, 3051, 7781],
    "no fencing on missing heartbeats": [6, 23, 29],
    "ids not yet visible skipped (no gaps kept)": [1, 2, 3],
    "a gap forgotten before its writers ended": [1, 2, 3],
    "a failed record resent before the refresh": [2, 5, 9],
    "settling skipped on revoke": [26, 103, 108],
    "the revoke callback returns before the core released partition 0": [26, 103, 108],
    "every election poll taken for one that saw its own heartbeat, no database fence": [6, 23, 29],
    "a mark error taken as a mark that found nothing": [14, 17, 34],
    "records sent past a refused record of their key": [1468, 2326, 2934],
    "a producer restart that forgets what was in flight": [3, 9, 15],
    "records produced without reading the topic's limit": [4, 6, 8],
    "batches not fitted to the topic's limit": [4, 6, 8],
    "a key's first records sent together (on a new producer)": [5, 9, 12],
    "an acknowledgement at an offset already written taken for delivery": [1, 2, 4],
    "purges committed asynchronously with one record per key in flight": [8, 12, 16],
    # Shards (SHARD_MUTATIONS, tests/sim/shard_scenario.py).
    "a shard's fence let go at once when its term ends": [13, 155, 166],
    "an engine whose shard moved keeps running": [1, 2, 3],
    "an engine kept through a revoke of its shard that came straight back": [5, 8, 12],
    "a failed engine started again at once, without a backoff": [3, 8, 10],
    "a failed engine never started again": [3, 10, 11],
    "a stopping replica leaves its group before its engines settled": [3, 4, 6],
    "a status report that credits one replica with another's shards": [1, 2, 3],
    "a shard's mark reads every shard's rows": [1, 2, 3],
    "a shard taken from a leader that did not settle, at once": [212, 467, 1092],
    # Many outboxes in one process (MANY_MUTATIONS, tests/sim/many_scenario.py).
    "a dropped outbox's engine kept running": [6, 7, 10],
    "a failed discovery taken for no outbox at all": [297, 303, 368],
    "a failed outbox engine started again at once": [4, 7, 9],
    # The queue (tests/sim/queue_mutations.py).
    "a tracker that takes the last stable offset for the end of its partition": [30, 109, 121],
    "a tracker that redelivers before reading its partition to the end": [138, 410, 596],
    "a tracker that ignores KeepAlives": [2, 4, 5],
    "dead-lettering one delivery early": [1, 2, 6],
    "a tracker that commits past messages in progress": [1, 2, 4],
    "the End marker sent before the handler's transaction committed (the inbox)": [2, 6, 7],
    "a consumer that commits its offsets before writing the Start markers": [1, 2, 3],
    "a consumer that reads on when max_in_progress messages are held": [1, 3, 4],
    "a consumer that commits other queues' offsets in partitions taken from it": [99, 243, 262],
    "a consumer that ends on a fatal error of its transactional producer": [2, 9, 17],
    "a tracker that ends on a fatal error of its transactional producer": [7, 27, 30],
    # The share backend (tests/sim/share_mutations.py).
    "a share record REJECTed before its dead letter is written": [3, 5, 8],
    "buffered share records handed out however near their lock's end": [1, 4, 5],
    "a share record dead on arrival only past max_deliveries + 1": [1, 2, 3],
    "a share record dead on arrival at max_deliveries": [1, 2, 3],
    "a share handler's failure on the last delivery RELEASEd": [1, 2, 3],
    "the share group left at Kafka's default start offset (latest)": [1, 2, 3],
    "a share verdict for now meant local time 0.0": [4, 9, 10],
    "a share record whose dead letter failed RELEASEd at once": [7, 8, 134],
    "a share Retry's lock counted from the hand-out, not the fetch": [228, 285, 458],
}


def run_mutant(name: str, seed: int) -> str | None:
    """The violation the mutation `name` causes on `seed`, or None."""
    if name in QUEUE_MUTATIONS:
        return queue_scenario.run(seed, QUEUE_MUTATIONS[name]).violation
    if name in SHARD_MUTATIONS:
        return shard_scenario.run(seed, SHARD_MUTATIONS[name]).violation
    if name in SHARE_MUTATIONS:
        return share_scenario.run(seed, SHARE_MUTATIONS[name]).violation
    if name in MANY_MUTATIONS:
        return many_scenario.run(seed, MANY_MUTATIONS[name]).violation
    return run(seed, MUTATIONS[name]).violation


def hunt(name: str, seeds: range, want: int) -> list[tuple[int, str]]:
    found = []
    for seed in seeds:
        violation = run_mutant(name, seed)
        if violation is not None:
            found.append((seed, violation))
            if len(found) >= want:
                break
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only run the seeds listed in CAUGHT_BY")
    parser.add_argument("--seeds", type=int, default=2000, help="seeds to search (default 2000)")
    parser.add_argument("--want", type=int, default=3, help="seeds to find per mutation (default 3)")
    parser.add_argument("--only", default="", help="only the mutations whose name contains this")
    parser.add_argument("--queue", action="store_true", help="only the queue's mutations")
    parser.add_argument("--shards", action="store_true", help="only the shards' mutations")
    parser.add_argument("--share", action="store_true", help="only the share backend's mutations")
    parser.add_argument("--many", action="store_true", help="only the many-outboxes process's mutations")
    args = parser.parse_args(argv)
    quiet()

    missed = 0
    only = [flag for flag in ("queue", "shards", "share", "many") if getattr(args, flag)]
    names = [*([] if only else MUTATIONS), *(QUEUE_MUTATIONS if not only or "queue" in only else []),
             *(SHARD_MUTATIONS if not only or "shards" in only else []),
             *(SHARE_MUTATIONS if not only or "share" in only else []),
             *(MANY_MUTATIONS if not only or "many" in only else [])]
    for name in names:
        if args.only not in name:
            continue
        if args.check:
            caught = [(seed, run_mutant(name, seed)) for seed in CAUGHT_BY[name]]
            lost = [seed for seed, violation in caught if not violation]
            caught = [(seed, violation) for seed, violation in caught if violation]
        else:
            caught = hunt(name, range(1, args.seeds + 1), args.want)
            lost = []
        print(f"{name}: " + (", ".join(str(seed) for seed, _ in caught) if caught else "NOT CAUGHT")
              + (f" (no longer: {', '.join(map(str, lost))})" if lost else ""))
        for seed, violation in caught[:1]:
            print(f"    seed {seed}: {violation}")
        missed += not caught or bool(lost)  # the unit tests want every seed listed to catch
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
