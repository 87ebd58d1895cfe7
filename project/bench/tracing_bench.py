"""`manage.py outbox_bench tracing`: what OpenTelemetry tracing costs stash() and the harvester's drain.

stash: the same writes with OUTBOX["tracing"] off, on with no span current, and on inside a sampled
span (one per transaction, as a traced request would have; started and ended outside the timed
part, since a traced application pays for it anyway), in interleaved rounds; medians. Spans go
to an SDK tracer provider whose batch processor drops them, so exporting is not measured.

drain: a backlog whose records carry a traceparent (one per ten records, as requests that each
stash ten would), drained by `manage.py harvest` with tracing off and on (the example project's
"discard" SDK, project/otel.py), alternately; medians of records/s.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.db import connections, transaction
from django.test import override_settings

from outbox.models import OutboxRecord
from outbox.stasher import stash, stash_many

BENCH_TOPIC = "outbox-bench-tracing"


def bench_stash(write: Callable[[str], None], rows: int, batch: int, rounds: int, database: str) -> None:
    from opentelemetry import trace

    from project import otel

    otel.configure("discard")
    tracer = trace.get_tracer("outbox-bench")
    value = "v" * 100
    write(f"stash() with tracing: {rows:,} rows a round, {batch} a transaction, {rounds} interleaved rounds")
    # "off, header given": tracing off, the same traceparent passed as an ordinary header; what storing
    # the header costs the database, apart from tracing.
    modes = ("off", "on, no span", "on, in a span", "off, header given")
    given = [("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")]
    results: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for writer in ("stash() loop", "stash_many()"):
            for mode in modes:
                tracing = mode != "off"
                with override_settings(OUTBOX={**settings.OUTBOX, "tracing": tracing}):
                    elapsed = 0.0
                    headers = [("source", "bench"), *(given if mode == "off, header given" else ())]
                    for start in range(0, rows, batch):
                        records = [{"topic": BENCH_TOPIC, "key": f"k{(start + i) % 1000}", "value": value,
                                    "headers": headers} for i in range(min(batch, rows - start))]
                        span = tracer.start_span("request") if mode == "on, in a span" else None
                        token = trace.use_span(span) if span is not None else None
                        if token is not None:
                            token.__enter__()
                        began = time.perf_counter()
                        with transaction.atomic(using=database):
                            if writer == "stash() loop":
                                for record in records:
                                    stash(**record, using=database)
                            else:
                                stash_many(records, using=database)
                        elapsed += time.perf_counter() - began
                        if token is not None:
                            token.__exit__(None, None, None)
                            span.end()
                    results.setdefault((writer, mode), []).append(rows / elapsed)
                traced = OutboxRecord.objects.using(database).filter(
                    kafka_topic=BENCH_TOPIC, kafka_header_keys__contains=["traceparent"]).count()
                if traced != (rows if mode in ("on, in a span", "off, header given") else 0):  # as they say
                    raise RuntimeError(f"{writer}, tracing {mode}: {traced} of {rows} rows have a traceparent")
                OutboxRecord.objects.using(database).filter(kafka_topic=BENCH_TOPIC).delete()
    for writer in ("stash() loop", "stash_many()"):
        base = statistics.median(results[(writer, "off")])
        for mode in modes:
            runs = results[(writer, mode)]
            median = statistics.median(runs)
            write(f"  {writer:<13} tracing {mode:<17} median {median:>9,.0f} rows/s ({_change(median, base)}); "
                  f"rounds {' / '.join(f'{r:,.0f}' for r in runs)}")
    connections[database].close()


def add_trace_context(every: int = 10) -> int:
    """Give every row of the outbox a traceparent, one trace per `every` consecutive ids (sampled)."""
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "UPDATE outbox SET kafka_header_keys = ARRAY['traceparent'], kafka_header_values = ARRAY["
            "'00-' || lpad(to_hex(id / %s + 1), 32, '0') || '-' || lpad(to_hex(id / %s + 1), 16, '0') || '-01']",
            [every, every])
        return cursor.rowcount


def bench_drain(command: Any, records: int, keys: int, rounds: int, partitions: int,
                harvest_args: list[str]) -> None:
    from project.bench.management.commands.outbox_bench import HarvesterProcess
    from project.bench.management.commands.outbox_pump import pump

    command._require_empty_outbox()
    write = command.stdout.write
    write(f"drain with tracing: {records:,} records over {keys:,} keys, a traceparent per ten records, "
          f"{rounds} rounds of off / on")
    results: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(rounds):
        for mode in ("off", "on"):
            command._vacuum()
            topic = command._create_topic(f"bench-tracing-{mode}", partitions)
            pump(records=records, keys=keys, topic=topic)
            add_trace_context()
            env = {"OUTBOX_TRACING": "1" if mode == "on" else "0"}
            if mode == "on":
                env["OUTBOX_EXAMPLE_OTEL"] = "discard"
            with HarvesterProcess(harvest_args, env=env) as harvester:
                started = harvester.wait_for_leadership()
                while command._outbox_has_rows():
                    time.sleep(0.05)
                elapsed = time.time() - started
            results[mode].append(records / elapsed)
            write(f"  tracing {mode:<3} {records / elapsed:>9,.0f} records/s; harvester peak RSS "
                  f"{harvester.peak_rss / 2**20:.0f} MiB")
            command._delete_topic(topic)
    base = statistics.median(results["off"])
    for mode in ("off", "on"):
        median = statistics.median(results[mode])
        write(f"  tracing {mode:<3} median {median:>9,.0f} records/s ({_change(median, base)})")


def _change(value: float, base: float) -> str:
    return "baseline" if value == base else f"{(value - base) / base * 100:+.1f}% vs off"
