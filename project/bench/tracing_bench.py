"""`manage.py outbox_bench tracing`: what OpenTelemetry tracing costs stash() and the harvester's drain.

stash: the same writes with OUTBOX["tracing"] off, on with no span current, and on inside a sampled
span (one per transaction, as a traced request would have; started and ended outside the timed
part, since a traced application pays for it anyway), in interleaved rounds; medians. Spans go
to an SDK tracer provider whose batch processor drops them, so exporting is not measured.

drain: a backlog whose records carry a traceparent (one per ten records, as requests that each
stash ten would), drained by `manage.py harvest` with tracing off, off with the SDK loaded, and on
(the example project's "discard" SDK, project/otel.py), taking turns; medians of records/s and of
the harvester process's CPU time per record.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import psutil
from django.db import connections, transaction

from outbox.models import OutboxRecord
from outbox.stasher import stash, stash_many

BENCH_TOPIC = "outbox-bench-tracing"


def bench_stash(write: Callable[[str], None], rows: int, batch: int, rounds: int, database: str) -> None:
    from opentelemetry import trace

    from outbox.tracing import switch
    from project import otel

    otel.configure("discard")
    tracer = trace.get_tracer("outbox-bench")
    value = "v" * 100
    given = [("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")]
    # "off, header given": tracing off, the same traceparent passed as an ordinary header: what storing
    # the header costs, apart from tracing. Modes take turns transaction by transaction (the order
    # rotating), so a neighbour's load falls on all of them alike; the switch is set directly (it is
    # what OUTBOX["tracing"] decides), so no settings change is timed.
    modes = ("off", "on, no span", "on, in a span", "off, header given")
    write(f"stash() with tracing: {rows:,} rows a round and mode, {batch} a transaction, {rounds} rounds, "
          f"modes taking turns by transaction")
    results: dict[tuple[str, str], list[float]] = {}
    try:
        for _ in range(rounds):
            for writer in ("stash() loop", "stash_many()"):
                elapsed = dict.fromkeys(modes, 0.0)
                for number, start in enumerate(range(0, rows, batch)):
                    for mode in modes[number % len(modes):] + modes[:number % len(modes)]:
                        headers = [("source", "bench"), *(given if mode == "off, header given" else ())]
                        records = [{"topic": BENCH_TOPIC, "key": f"k{(start + i) % 1000}", "value": value,
                                    "headers": headers} for i in range(min(batch, rows - start))]
                        switch._on = mode.startswith("on")
                        elapsed[mode] += _timed(writer, records, database,
                                                tracer if mode == "on, in a span" else None)
                for mode in modes:
                    results.setdefault((writer, mode), []).append(rows / elapsed[mode])
                traced = OutboxRecord.objects.using(database).filter(
                    kafka_topic=BENCH_TOPIC, kafka_header_keys__contains=["traceparent"]).count()
                if traced != 2 * rows:  # "on, in a span" and "off, header given" did what they say
                    raise RuntimeError(f"{writer}: {traced} rows have a traceparent, expected {2 * rows}")
                OutboxRecord.objects.using(database).filter(kafka_topic=BENCH_TOPIC).delete()
    finally:
        switch.reset()
    _report(write, results, modes)
    _python_cost(write, tracer, value)
    connections[database].close()


def _timed(writer: str, records: list[dict[str, Any]], database: str, tracer: Any) -> float:
    """Seconds to write `records` in one transaction; inside a span of `tracer` (not timed) if given."""
    from opentelemetry import trace

    span = tracer.start_span("request") if tracer is not None else None
    with trace.use_span(span) if span is not None else contextlib.nullcontext():
        began = time.perf_counter()
        with transaction.atomic(using=database):
            if writer == "stash() loop":
                for record in records:
                    stash(**record, using=database)
            else:
                stash_many(records, using=database)
        took = time.perf_counter() - began
    if span is not None:
        span.end()
    return took


def _report(write: Callable[[str], None], results: dict[tuple[str, str], list[float]], modes: tuple[str, ...]) -> None:
    for writer in ("stash() loop", "stash_many()"):
        base = statistics.median(results[(writer, "off")])
        for mode in modes:
            runs = results[(writer, mode)]
            median = statistics.median(runs)
            write(f"  {writer:<13} tracing {mode:<17} median {median:>9,.0f} rows/s ({_change(median, base)}); "
                  f"rounds {' / '.join(f'{r:,.0f}' for r in runs)}")


def _python_cost(write: Callable[[str], None], tracer: Any, value: str) -> None:
    """stash()'s own Python work per record (validation and the added headers, no database), which a
    loaded machine's database round trips do not blur."""
    from opentelemetry import trace

    from outbox.stasher import _decorate
    from outbox.tracing import switch
    from outbox.validation import clean

    def per_record(on: bool, in_span: bool, count: int = 50_000) -> float:
        switch._on = on
        span = tracer.start_span("request") if in_span else None
        try:
            with trace.use_span(span) if span is not None else contextlib.nullcontext():
                began = time.perf_counter()
                for n in range(count):
                    row = clean(BENCH_TOPIC, f"k{n % 1000}", value, [("source", "bench")], max_value_bytes=900_000,
                                max_header_bytes=65536)
                    _decorate(row, None, current_headers() if switch.tracing_on() else None)
                return (time.perf_counter() - began) / count * 1e6
        finally:
            if span is not None:
                span.end()
            switch.reset()

    from outbox.tracing.propagation import current_headers

    cases = (("off", False, False), ("on, no span", True, False), ("on, in a span", True, True))
    runs: dict[str, list[float]] = {label: [] for label, _, _ in cases}
    for _ in range(7):  # the cases take turns, so load falls on each alike; the fastest run is the least disturbed
        for label, on, in_span in cases:
            runs[label].append(per_record(on, in_span, 20_000))
    for label, _, _ in cases:
        found = sorted(runs[label])
        write(f"  stash()'s Python work per record, tracing {label:<14} fastest {found[0]:.2f} us, "
              f"median {found[3]:.2f} us")


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
          f"{rounds} rounds of off / off with the SDK loaded / on")
    # "off+sdk": tracing off in a process that has loaded the SDK anyway: what loading it costs, apart.
    modes = ("off", "off+sdk", "on")
    results: dict[str, list[float]] = {mode: [] for mode in modes}
    cpu: dict[str, list[float]] = {mode: [] for mode in modes}
    for number in range(rounds):
        for mode in modes[number % 3:] + modes[:number % 3]:  # none always goes first
            command._vacuum()
            topic = command._create_topic(f"bench-tracing-{mode.replace('+', '-')}", partitions)
            pump(records=records, keys=keys, topic=topic)
            add_trace_context()
            env = {"OUTBOX_TRACING": "1" if mode == "on" else "0"}
            if mode != "off":
                env["OUTBOX_EXAMPLE_OTEL"] = "discard"
            with HarvesterProcess(harvest_args, env=env) as harvester:
                started = harvester.wait_for_leadership()
                process = psutil.Process(harvester.process.pid)
                cpu_before = sum(process.cpu_times()[:2])
                while command._outbox_has_rows():
                    time.sleep(0.05)
                elapsed = time.time() - started
                cpu_used = sum(process.cpu_times()[:2]) - cpu_before
            results[mode].append(records / elapsed)
            cpu[mode].append(cpu_used / records * 1e6)
            write(f"  tracing {mode:<7} {records / elapsed:>9,.0f} records/s, harvester CPU "
                  f"{cpu_used / records * 1e6:5.1f} us a record; peak RSS {harvester.peak_rss / 2**20:.0f} MiB; "
                  f"load average {os.getloadavg()[0]:.1f}")
            command._delete_topic(topic)
    base, base_cpu = statistics.median(results["off"]), statistics.median(cpu["off"])
    for mode in modes:
        median, median_cpu = statistics.median(results[mode]), statistics.median(cpu[mode])
        write(f"  tracing {mode:<7} median {median:>9,.0f} records/s ({_change(median, base)}), "
              f"harvester CPU {median_cpu:.1f} us a record ({_change(median_cpu, base_cpu)})")


def _change(value: float, base: float) -> str:
    return "baseline" if value == base else f"{(value - base) / base * 100:+.1f}% vs off"
