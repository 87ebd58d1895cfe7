"""The garbage collector of `manage.py harvest`, tuned for a process that allocates a few container
objects per record and keeps few cycles.

CPython collects its youngest generation every 700 net allocations of container objects, and each
collection of the older generations walks every live object, Django's and the imports' included
(hundreds of thousands, none of them ever garbage). In a drain that was a third of the harvester's CPU.
So, once the process is set up: what is alive is frozen (a permanent generation no collection walks),
and the young generation is collected every 50,000 allocations instead, which keeps cyclic garbage
to a few MiB at most. Only the command calls this: a process that embeds the harvester keeps its own
collector settings (and the queue's consumer runs the user's handlers, whose garbage is theirs).
"""

from __future__ import annotations

import gc

#: Net container allocations between collections of the youngest generation (CPython's default: 700).
YOUNG_THRESHOLD = 50_000


def tune_gc() -> None:
    """Freeze what the process set up so far and collect the young generation less often."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
