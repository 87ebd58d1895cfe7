"""What both simulators' scenarios share: logging kept quiet over thousands of runs, and the command line that
replays seeds (`python -m tests.sim.scenario 818 --trace`, `python -m tests.sim.queue_scenario 818 --trace`)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any


def quiet() -> None:
    """The engine and the queue log what they do; a simulation of thousands of runs keeps it to itself."""
    logging.getLogger("outbox").setLevel(logging.CRITICAL)


def quietly(run: Callable[..., Any], seed: int) -> tuple[int, str | None, str]:
    """`run(seed)`, quiet, as a pool of processes wants it: (seed, violation or None, summary). Each scenario's
    `run_quietly` is this with its own `run` (a partial, which a spawned worker can unpickle)."""
    quiet()
    result = run(seed)
    return seed, result.violation, result.summary


def main(argv: list[str], run: Callable[..., Any], description: str | None) -> int:
    """Run each seed given, print ok/FAIL with its summary (and its trace with --trace); 1 if any failed."""
    quiet()
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("seeds", type=int, nargs="+")
    parser.add_argument("--trace", action="store_true")
    args = parser.parse_args(argv)
    failed = 0
    for seed in args.seeds:
        result = run(seed, trace=args.trace)
        print(("ok   " if result.ok else "FAIL ") + result.summary)
        if not result.ok:
            failed += 1
            print("     " + str(result.violation))
        if args.trace:
            print("\n".join(result.trace))
    return 1 if failed else 0
