"""Deliberate bugs, to show the simulator has teeth: for each, some seed must fail.

    python -m tests.sim.mutations            # for each bug, the first seeds that catch it
    python -m tests.sim.mutations --check    # only the seeds listed in CAUGHT_BY (what CI runs)

Each mutation is a small change to the real core (a subclass) or to the simulated table's SQL; the
runs use one record per key in flight, goharvest's mode, where the stricter order applies.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from outbox.harvest.core import Core, EntryState, Lane
from tests.sim.scenario import Options, quiet, run


class BarrierOnAck(Core):
    """Frees a key's slot when Kafka acknowledges its record, not when the purge has committed."""

    def _slots(self, lane: Lane) -> int:
        busy = sum(1 for entry in lane.unsettled if entry.state is not EntryState.ACKED)
        return (1 if lane.single or lane.retrying else self.limits.max_in_flight_per_key) - busy


class ReusedLeaderId(Core):
    """Keeps its leader id when it refreshes after a failure."""

    def _begin_term(self) -> None:
        previous = getattr(self, "_last_leader_id", None)
        super()._begin_term()
        if previous is not None:
            self.leader_id = previous
            self._commands[-1] = type(self._commands[-1])(previous)
        self._last_leader_id = self.leader_id


class NoHeartbeatFence(Core):
    """Goes on sending when it no longer sees its own heartbeats."""

    def tick(self, now: float) -> None:
        self._heartbeat_seen_at = max(self._heartbeat_seen_at, now)
        super().tick(now)


class ResendBeforeRefresh(Core):
    """After a failed delivery, resets the row and carries on under the same leader id."""

    def _remark(self) -> None:
        if self.force_remark or self._to_reset:  # the failed-delivery path: skip the re-mark
            self.force_remark = False
            return
        super()._remark()


def _core(kind: type[Core]) -> Callable[..., Core]:
    return lambda *args, **kwargs: kind(*args, **kwargs)


MUTATIONS: dict[str, Options] = {
    "barrier lowered on the ack instead of after the purge": Options(core_factory=_core(BarrierOnAck), per_key=1),
    "a leader id reused": Options(core_factory=_core(ReusedLeaderId), per_key=1),
    # The database fence stops a stale leader too; without it (PgBouncer in transaction mode) only
    # the heartbeat fence does.
    "no fencing on missing heartbeats": Options(core_factory=_core(NoHeartbeatFence), per_key=1, db_fence=False),
    "purging without the leader-id guard": Options(guard_purges=False, per_key=1),
    "a failed record resent before the refresh": Options(core_factory=_core(ResendBeforeRefresh), per_key=1),
}

#: Seeds that catch each mutation, as `python -m tests.sim.mutations` found them. A change to the
#: simulator or the core can change which seeds catch what: run it again and update this list
#: (and docs/simulation.md).
CAUGHT_BY: dict[str, list[int]] = {
    "barrier lowered on the ack instead of after the purge": [84, 191, 278],
    "a leader id reused": [3, 4, 5],
    "no fencing on missing heartbeats": [6, 17, 23],
    "purging without the leader-id guard": [1558],
    "a failed record resent before the refresh": [9, 16, 24],
}


def hunt(name: str, seeds: range, want: int) -> list[tuple[int, str]]:
    found = []
    for seed in seeds:
        result = run(seed, MUTATIONS[name])
        if not result.ok:
            found.append((seed, result.violation))
            if len(found) >= want:
                break
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only run the seeds listed in CAUGHT_BY")
    parser.add_argument("--seeds", type=int, default=2000, help="seeds to search (default 2000)")
    parser.add_argument("--want", type=int, default=3, help="seeds to find per mutation (default 3)")
    args = parser.parse_args(argv)
    quiet()
    missed = 0
    for name in MUTATIONS:
        if args.check:
            caught = [(seed, run(seed, MUTATIONS[name]).violation) for seed in CAUGHT_BY[name]]
            caught = [(seed, violation) for seed, violation in caught if violation]
        else:
            caught = hunt(name, range(1, args.seeds + 1), args.want)
        print(f"{name}: " + (", ".join(str(seed) for seed, _ in caught) if caught else "NOT CAUGHT"))
        for seed, violation in caught[:1]:
            print(f"    seed {seed}: {violation}")
        missed += not caught
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
