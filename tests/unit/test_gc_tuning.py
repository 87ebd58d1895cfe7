"""tune_gc(): what the harvest command does to the collector (docs/benchmarks.md measures why)."""

from __future__ import annotations

import gc

from outbox.gc_tuning import YOUNG_THRESHOLD, tune_gc


def test_tune_gc_freezes_what_is_alive_and_collects_the_young_less_often():
    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_freeze_count() > 10_000  # Django, the engine and their imports: never walked again
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *before[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)

