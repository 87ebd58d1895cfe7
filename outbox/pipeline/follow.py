"""Follow mode: the same audit as Structured Streaming, resumable from a checkpoint folder.

`<checkpoint>/spark` is Spark's checkpoint (offsets and commits of the Kafka source);
`<checkpoint>/state` holds the audit's state, one version per folded micro-batch (see state.py).
Each micro-batch is folded into the previous version inside foreachBatch, so a restart resumes
where the last run stopped and a micro-batch that Spark replays is not counted again. Delete the
whole checkpoint folder to start over. The output tables are written after the version's state
and before it counts as folded, so a crash in between redoes both: a Parquet `latest` is
rewritten from the state; Delta tables (`sink`, `latest`) get one commit per micro-batch, which
Delta skips when a replayed micro-batch finds it already there (delta_table.py).

A run stops when `once` is set (Spark's availableNow trigger: everything there at start, then
stop), after `max_batches` folded micro-batches, after `idle_timeout` seconds without a
micro-batch (counted from the start or the end of the last one, never during one), or on
SIGINT/SIGTERM (after the micro-batch under way).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from outbox.pipeline import audit, delta_table, preflight, sink, sources
from outbox.pipeline import latest as latest_state
from outbox.pipeline.state import Offsets, Outputs, StateError, StateStore
from outbox.stopping import on_stop_signals


@dataclass
class FollowOptions:
    checkpoint: str
    once: bool = False
    max_batches: int | None = None
    idle_timeout: float | None = None
    trigger_interval: str = "5 seconds"
    max_offsets_per_trigger: int | None = None
    examples: int = 10
    latest: str | None = None  # folder of the latest-state table, kept in step with each batch
    sink: str | None = None  # folder of the de-duplicated table (Delta only), appended to by each batch
    table_format: str = "parquet"  # of `latest` and `sink`
    tombstones: latest_state.Tombstones = "delete"

    def outputs(self) -> Outputs:
        """What this run keeps in step with its state, folders as absolute paths where local."""
        return Outputs(sink=_where(self.sink), sink_format=self.table_format if self.sink else None,
                       latest=_where(self.latest), latest_format=self.table_format if self.latest else None,
                       tombstones=self.tombstones)


def _where(path: str | None) -> str | None:
    if path is None:
        return None
    return path.rstrip("/") if preflight.has_scheme(path) else os.path.abspath(path.removeprefix("file://"))


@dataclass
class FollowRun:
    """What this run did: batches folded and skipped (already folded before a restart)."""

    folded: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    stopped_because: str = ""


def check_state(spark: SparkSession, options: FollowOptions) -> None:
    """Raise StateError, before the stream starts, when the saved state cannot serve this run.

    An output the checkpoint did not keep would miss what earlier micro-batches wrote; a Delta table
    in another folder, or kept with the other tombstone rule, would be out of step with the state.
    """
    store = StateStore(spark, f"{options.checkpoint.rstrip('/')}/state")
    found = store.latest()
    if found is None:
        return
    before, wanted, checkpoint = store.outputs(found[0]), options.outputs(), options.checkpoint
    start_over = "give a new --checkpoint to start over"
    for name in ("sink", "latest"):
        flag, kept, asked = f"--{name}", getattr(before, f"{name}_format"), getattr(wanted, f"{name}_format")
        if asked is None:
            continue
        if kept is None:
            raise StateError(f"{flag}: the checkpoint {checkpoint} was started without {flag}, so the table would "
                             f"miss what earlier micro-batches wrote; {start_over}")
        if kept != asked:
            raise StateError(f"{flag}: the checkpoint {checkpoint} keeps {flag} as --format {kept}, not {asked}; "
                             f"{start_over}")
        if asked == delta_table.FORMAT and getattr(before, name) != getattr(wanted, name):
            raise StateError(f"{flag} {getattr(options, name)}: the checkpoint {checkpoint} keeps its Delta table "
                             f"in {getattr(before, name)}; give that folder, or {start_over}")
    if wanted.latest_format == delta_table.FORMAT and before.tombstones != wanted.tombstones:
        raise StateError(f"--tombstones {wanted.tombstones}: the checkpoint {checkpoint} keeps the Delta --latest "
                         f"with --tombstones {before.tombstones}; {start_over}")
    if wanted.latest_format == delta_table.FORMAT and not delta_table.exists(spark, str(before.latest)):
        # Each micro-batch MERGEs into the table. This also loads its log once, at the start, rather than in the
        # first micro-batch.
        raise StateError(f"--latest {options.latest}: the checkpoint {checkpoint} keeps a Delta table there, and "
                         f"there is none (deleted?); restore it, or {start_over}")


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

    delta_latest = bool(options.latest) and options.table_format == delta_table.FORMAT
    query_ids: dict[str, str] = {}

    def commit_of(batch_id: int) -> delta_table.Commit:
        if "id" not in query_ids:
            query_ids["id"] = store.query_id(spark_checkpoint)
        return delta_table.Commit(app_id=query_ids["id"], batch_id=batch_id)

    def write_outputs(session: SparkSession, batch_id: int, batch: DataFrame, before: audit.AuditState | None,
                      folded: audit.AuditState, saved: audit.AuditState) -> None:
        """The output tables after `batch`: written before the state's version is marked folded."""
        began = time.monotonic()
        if options.latest and not delta_latest:
            assert saved.latest is not None
            latest_state.write(saved.latest, options.latest, tombstones=options.tombstones)
            log(f"batch {batch_id}: --latest rewritten in {time.monotonic() - began:.1f}s")
        if options.sink:
            sink.append(batch, before.ids if before else None, options.sink, commit_of(batch_id))
            log(f"batch {batch_id}: --sink appended in {time.monotonic() - began:.1f}s")
        if delta_latest:
            began = time.monotonic()
            assert options.latest is not None and folded.batch_keys is not None
            detail = ""
            if before is None:  # a checkpoint that starts over: the table starts over too
                latest_state.write(latest_state.fold(None, None, batch, folded.batch_keys), options.latest,
                                   table_format=delta_table.FORMAT, tombstones=options.tombstones,
                                   commit=commit_of(batch_id))
            else:
                changed = latest_state.changes(before.keys, batch, folded.batch_keys)
                detail = f" (the changed keys found in {time.monotonic() - began:.1f}s)"
                latest_state.merge(session, options.latest, changed, commit_of(batch_id), options.tombstones)
            log(f"batch {batch_id}: --latest merged in {time.monotonic() - began:.1f}s{detail}")

    def fold_batch(frame: DataFrame, batch_id: int) -> None:
        activity["busy"] = True
        try:
            if store.folded(batch_id):
                run.skipped.append(batch_id)
                log(f"batch {batch_id}: already folded before a restart, skipped")
                return
            began = time.monotonic()
            previous = store.latest(before=batch_id)
            before = previous[1] if previous else None
            batch = audit.normalize(frame)
            if delta_latest or options.sink:
                # Read from Kafka once: the checks, the sink and the MERGE's changed keys all read the batch.
                batch = batch.persist()
            folded = None
            try:  # whatever fails, the cached frames go (a long-lived session would keep them)
                folded = audit.fold(before, batch, batch_id=batch_id, examples=options.examples,
                                    latest=bool(options.latest) and not delta_latest,
                                    whole_partitions=kafka.whole_partitions, topics=topics)
                offsets = covered(previous[2] if previous else {}, _start(batch_id),
                                  store.spark_offsets(spark_checkpoint, batch_id) or {})
                outputs = options.outputs()
                if folded.latest is not None and outputs.latest_format is None:  # the state still keeps it
                    outputs = replace(outputs, latest_format="parquet")
                done = folded

                def before_marking(saved: audit.AuditState) -> None:
                    write_outputs(frame.sparkSession, batch_id, batch, before, done, saved)

                saved = store.save(batch_id, folded, offsets, before_marking=before_marking, outputs=outputs)
            finally:
                if folded is not None:
                    folded.release()
                if batch.is_cached:
                    batch.unpersist()
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
    with on_stop_signals(stop_requested.set):
        while query.isActive:
            query.awaitTermination(0.5)
            if failure:
                break
            if activity["busy"]:  # never stop a micro-batch half-way
                continue
            if not activity["started"]:
                activity.update(last=time.monotonic(), started=_first_trigger_done(query.status, run))
            if stop_requested.is_set():
                reason = "signal"
            elif options.max_batches is not None and len(run.folded) >= options.max_batches:
                reason = f"{options.max_batches} batches folded"
            elif options.idle_timeout is not None and time.monotonic() - activity["last"] >= options.idle_timeout:
                reason = f"idle for {options.idle_timeout:g}s"
            else:
                continue
            if not _committed(query.lastProgress, run):  # a stop now would make the next run replay it
                continue
            run.stopped_because = reason
            break
        query.stop()
        if not run.stopped_because and not failure:
            run.stopped_because = "all available data read (--once)"
        error = query.exception()
    if failure:
        raise failure[0]
    if error is not None:
        raise error
    newest = store.latest()
    return (newest[1], newest[2], run) if newest else (None, {}, run)


def _committed(progress: dict[str, Any] | None, run: FollowRun) -> bool:
    """Whether Spark has recorded the commit of the newest micro-batch this run folded or skipped.

    foreachBatch returns before Spark writes the batch to its commit log; Spark reports the
    trigger's progress after it has. Stopping in between is safe (the next run replays the
    batch and skips it) but not what the run reported.
    """
    newest = max(run.folded + run.skipped, default=None)
    return newest is None or (progress is not None and progress["batchId"] >= newest)


def _first_trigger_done(status: dict[str, Any], run: FollowRun) -> bool:
    """Whether Spark has run a trigger: a batch came, or the stream waits for the next one."""
    return bool(run.folded or run.skipped) or str(status.get("message", "")).startswith("Waiting")
