"""Follow mode: the same audit as Structured Streaming, resumable from a checkpoint folder.

`<checkpoint>/spark` is Spark's checkpoint (offsets and commits of the Kafka source);
`<checkpoint>/state` holds the audit's state, one version per folded micro-batch (see state.py).
Each micro-batch is folded into the previous version inside foreachBatch, so a restart resumes
where the last run stopped and a micro-batch that Spark replays is not counted again. Delete the
whole checkpoint folder to start over. With `latest`, the latest-state table is rewritten from
each version before the version counts as folded, so a crash in between redoes both.

A run stops when `once` is set (Spark's availableNow trigger: everything there at start, then
stop), after `max_batches` folded micro-batches, after `idle_timeout` seconds without a
micro-batch (counted from the start or the end of the last one, never during one), or on
SIGINT/SIGTERM (after the micro-batch under way).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from outbox.pipeline import audit, sources
from outbox.pipeline import latest as latest_state
from outbox.pipeline.state import Offsets, StateError, StateStore


@dataclass
class FollowOptions:
    checkpoint: str
    once: bool = False
    max_batches: int | None = None
    idle_timeout: float | None = None
    trigger_interval: str = "5 seconds"
    max_offsets_per_trigger: int | None = None
    examples: int = 10
    latest: str | None = None  # folder of the latest-state table, rewritten after each batch


@dataclass
class FollowRun:
    """What this run did: batches folded and skipped (already folded before a restart)."""

    folded: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    stopped_because: str = ""


def check_state(spark: SparkSession, options: FollowOptions) -> None:
    """Raise StateError, before the stream starts, when the saved state cannot serve this run."""
    store = StateStore(spark, f"{options.checkpoint.rstrip('/')}/state")
    found = store.latest()
    if found is not None and options.latest and found[1].latest is None:
        raise StateError(f"--latest: the checkpoint {options.checkpoint} was started without --latest, so it "
                         f"has no latest state to continue; give a new --checkpoint to start over")


def covered(previous: Offsets, start: dict[str, dict[str, int]], end: dict[str, dict[str, int]]) -> Offsets:
    """Offsets the state covers after a batch read from `start` to `end`: [first read, next to read]."""
    found = {topic: {p: list(pair) for p, pair in parts.items()} for topic, parts in previous.items()}
    for topic, parts in end.items():
        for partition, high in parts.items():
            low = found.get(topic, {}).get(partition, [start.get(topic, {}).get(partition, high)])[0]
            found.setdefault(topic, {})[partition] = [min(low, high), high]
    return found


def follow(spark: SparkSession, kafka: sources.Kafka, topics: Sequence[str], options: FollowOptions,
           on_state: Callable[[audit.AuditState, Offsets, FollowRun], None],
           log: Callable[[str], None]) -> tuple[audit.AuditState | None, Offsets, FollowRun]:
    """Run the stream until a stop condition; `on_state` sees the state after each folded batch.

    Returns the latest state (None when nothing was ever folded), the offsets it covers and what
    this run did.
    """
    check_state(spark, options)
    store = StateStore(spark, f"{options.checkpoint.rstrip('/')}/state")
    spark_checkpoint = f"{options.checkpoint.rstrip('/')}/spark"
    run = FollowRun()
    # Idle time counts from the last batch's end, or from the end of Spark's first trigger: a slow
    # start (a cold JVM, a loaded machine, a replayed batch) is not a stream without data.
    activity = {"last": time.monotonic(), "busy": False, "started": False}
    failure: list[BaseException] = []

    def _start(batch_id: int) -> dict[str, dict[str, int]]:
        """Where micro-batch `batch_id` started: the previous batch's end, or Kafka's low watermarks."""
        previous = store.spark_offsets(spark_checkpoint, batch_id - 1) if batch_id else None
        if previous is not None:
            return previous
        low = sources.watermarks(kafka, sources.partitions(kafka, topics))
        return {topic: {str(p): pair[0] for p, pair in parts.items()} for topic, parts in low.items()}

    def fold_batch(frame: DataFrame, batch_id: int) -> None:
        activity["busy"] = True
        try:
            if store.folded(batch_id):
                run.skipped.append(batch_id)
                log(f"batch {batch_id}: already folded before a restart, skipped")
                return
            began = time.monotonic()
            previous = store.latest(before=batch_id)
            folded = audit.fold(previous[1] if previous else None, audit.normalize(frame), batch_id=batch_id,
                                examples=options.examples, latest=bool(options.latest),
                                whole_partitions=kafka.whole_partitions, topics=topics)
            offsets = covered(previous[2] if previous else {}, _start(batch_id),
                              store.spark_offsets(spark_checkpoint, batch_id) or {})
            write_latest = None
            if options.latest:
                path = options.latest

                def write_latest(state: audit.AuditState) -> None:
                    assert state.latest is not None
                    latest_state.write(state.latest, path)
            try:
                saved = store.save(batch_id, folded, offsets, before_marking=write_latest)
            finally:
                folded.release()
            run.folded.append(batch_id)
            log(f"batch {batch_id}: folded in {time.monotonic() - began:.1f}s")
            on_state(saved, offsets, run)
        except BaseException as error:  # surfaced by the main thread; Spark would only log it
            failure.append(error)
            raise
        finally:
            activity.update(last=time.monotonic(), busy=False)

    writer = (sources.read_stream(spark, kafka, topics, options.max_offsets_per_trigger)
              .writeStream.foreachBatch(fold_batch).option("checkpointLocation", spark_checkpoint))
    writer = writer.trigger(availableNow=True) if options.once else writer.trigger(
        processingTime=options.trigger_interval)
    query = writer.queryName("outbox-audit-follow").start()
    stop_requested = threading.Event()
    previous_handlers = _install_stop_handlers(stop_requested)
    try:
        while query.isActive:
            query.awaitTermination(0.5)
            if failure:
                break
            if activity["busy"]:  # never stop a micro-batch half-way
                continue
            if not activity["started"]:
                activity.update(last=time.monotonic(), started=_first_trigger_done(query.status, run))
            if stop_requested.is_set():
                run.stopped_because = "signal"
            elif options.max_batches is not None and len(run.folded) >= options.max_batches:
                run.stopped_because = f"{options.max_batches} batches folded"
            elif options.idle_timeout is not None and time.monotonic() - activity["last"] >= options.idle_timeout:
                run.stopped_because = f"idle for {options.idle_timeout:g}s"
            else:
                continue
            break
        query.stop()
        if not run.stopped_because and not failure:
            run.stopped_because = "all available data read (--once)"
        error = query.exception()
    finally:
        _restore_handlers(previous_handlers)
    if failure:
        raise failure[0]
    if error is not None:
        raise error
    newest = store.latest()
    return (newest[1], newest[2], run) if newest else (None, {}, run)


def _first_trigger_done(status: dict[str, Any], run: FollowRun) -> bool:
    """Whether Spark has run a trigger: a batch came, or the stream waits for the next one."""
    return bool(run.folded or run.skipped) or str(status.get("message", "")).startswith("Waiting")


def _install_stop_handlers(event: threading.Event) -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, lambda *_: event.set()) for sig in (signal.SIGINT, signal.SIGTERM)}


def _restore_handlers(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
