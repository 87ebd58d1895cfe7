"""The audit's command line: `python -m outbox.pipeline`, `spark-submit .../outbox/pipeline/cli.py`, and
`manage.py outbox_audit` (which adds defaults from Django settings and calls `run()`).

Exit status: 0 clean, 1 reversals or missing ids, 2 bad arguments, or Kafka, the master, the
jars, a path or the ledger not usable (one line on stderr, before Spark does any work), 3 the
audit started but Spark failed. This module imports pyspark only once those checks passed, so
that an install without it gets one line saying which extra to install.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from outbox.kafka.names import is_topic_name
from outbox.pipeline import jars as jar_lookup
from outbox.pipeline import preflight, sources
from outbox.pipeline import report as reports

EXIT_FAILED = 3
DEFAULT_MASTER = "local[*]"
DEFAULT_BOOTSTRAP_SERVERS = "localhost:9092"
SPARK_EXTRA = "pip install 'django-outbox-harvest[spark]'"


def pyspark_missing() -> str | None:
    """One line saying how to install PySpark when it cannot be imported, else None."""
    try:
        import pyspark  # noqa: F401
    except ImportError as error:
        return f"PySpark is needed for the audit and cannot be imported ({error}); install it with {SPARK_EXTRA}"
    return None


class UsageError(Exception):
    """Bad arguments: one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing usage and exiting."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise UsageError(message)


@dataclass
class Defaults:
    """What the caller knows better than the command line's defaults (the management command: settings)."""

    bootstrap_servers: str | None = None
    spark_jars: str | Sequence[str] | None = None
    ledger_url: str | None = None
    ledger_properties: dict[str, str] = field(default_factory=dict)
    #: librdkafka settings (the management command: OUTBOX's base_kafka_config); their security part
    #: (security.protocol, sasl.*, ssl.*) is used for the pre-flight check and passed to Spark's source.
    kafka_config: dict[str, Any] = field(default_factory=dict)


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    return 0 if text.strip() == "0" else _positive_int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _topics(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected one or more topic names, comma-separated")
    for name in names:
        if not is_topic_name(name):
            raise argparse.ArgumentTypeError(f"not a Kafka topic name: {name!r}")
    return list(dict.fromkeys(names))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The audit's options, shared by the plain command line and the management command."""
    parser.add_argument("--topics", type=_topics, required=True, metavar="T1,T2", help="topics to audit")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for report.json (created)")
    parser.add_argument("--bootstrap-servers", metavar="HOSTS",
                        help="Kafka bootstrap servers (default: $KAFKA_BOOTSTRAP_SERVERS, else localhost:9092)")
    parser.add_argument("--kafka-option", type=_pair, action="append", default=[], metavar="KEY=VALUE",
                        help="option for Spark's Kafka source, e.g. kafka.security.protocol=SSL (repeatable)")
    ledger = parser.add_argument_group("ledger of expected ids (for `missing`)")
    ledger.add_argument("--ledger", metavar="FILE", help="text file, one outbox id a line")
    ledger.add_argument("--ledger-table", metavar="TABLE", help="table (or `(SELECT ...) AS t`) read through JDBC")
    ledger.add_argument("--ledger-url", metavar="JDBC_URL", help="e.g. jdbc:postgresql://host:5432/db")
    ledger.add_argument("--ledger-column", default="id", metavar="COLUMN", help="id column (default: id)")
    ledger.add_argument("--ledger-property", type=_pair, action="append", default=[], metavar="KEY=VALUE",
                        help="JDBC connection property such as user=... (repeatable)")
    parser.add_argument("--sink", metavar="DIR",
                        help="write the de-duplicated records (follow mode: appended by every micro-batch, "
                             "--format delta only)")
    parser.add_argument("--latest", metavar="DIR",
                        help="write each key's newest record (follow mode: updated by every micro-batch)")
    parser.add_argument("--format", dest="table_format", choices=("parquet", "delta"), default=None,
                        help="table format of --sink and --latest (default: parquet); delta: a Delta Lake table, "
                             "one commit per run or micro-batch, --latest MERGEd")
    parser.add_argument("--tombstones", choices=("delete", "mark"), default=None,
                        help="what a tombstone does to its key's row in --latest: delete it (default), or keep "
                             "it with deleted=true")
    parser.add_argument("--examples", type=_non_negative_int, default=10, metavar="N",
                        help="examples kept of each kind of violation (default: 10)")
    spark = parser.add_argument_group("Spark")
    spark.add_argument("--master", help=f"Spark master (default: {DEFAULT_MASTER}, or spark-submit's)")
    spark.add_argument("--conf", type=_pair, action="append", default=[], metavar="KEY=VALUE",
                       help="Spark setting (repeatable), e.g. spark.driver.memory=8g")
    spark.add_argument("--executor-timeout", type=_seconds, default=60.0, metavar="SECONDS",
                       help="on a cluster master, how long to wait for a first executor (default: 60)")
    spark.add_argument("--jars", metavar="DIR|JAR,JAR",
                       help=f"Kafka connector jars (default: ${jar_lookup.ENV_VAR}, OUTBOX['spark_jars'], "
                            f".services/spark/jars-{jar_lookup.SPARK_VERSION})")
    follow = parser.add_argument_group("follow mode (Structured Streaming)")
    follow.add_argument("--follow", action="store_true", help="keep reading; resumable from --checkpoint")
    follow.add_argument("--checkpoint", metavar="DIR", help="checkpoint and state folder (default: OUT/checkpoint)")
    follow.add_argument("--once", action="store_true", help="read what is there now, then stop (availableNow)")
    follow.add_argument("--max-batches", type=_positive_int, metavar="N", help="stop after N folded micro-batches")
    follow.add_argument("--idle-timeout", type=_seconds, metavar="SECONDS",
                        help="stop after this long without a new micro-batch (from Spark's first trigger)")
    follow.add_argument("--trigger-interval", default="5 seconds", metavar="INTERVAL",
                        help="micro-batch interval (default: '5 seconds')")
    follow.add_argument("--max-offsets-per-trigger", type=_positive_int, metavar="N",
                        help="at most N messages a micro-batch")
    parser.add_argument("--kafka-timeout", type=_seconds, default=10.0, metavar="SECONDS",
                        help="how long to wait for Kafka's metadata before giving up (default: 10)")


def build_parser(prog: str = "python -m outbox.pipeline") -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog, description="Audit and de-duplicate topics written by the outbox harvester.")
    add_arguments(parser)
    return parser


def validate(args: argparse.Namespace, defaults: Defaults) -> None:
    """Combinations argparse cannot check; raises UsageError."""
    if args.ledger and args.ledger_table:
        raise UsageError("give --ledger or --ledger-table, not both")
    if args.ledger_table and not (args.ledger_url or defaults.ledger_url):
        raise UsageError("--ledger-table needs --ledger-url")
    if (args.ledger_url or args.ledger_property) and not args.ledger_table:
        raise UsageError("--ledger-url and --ledger-property go with --ledger-table")
    follow_only = [name for name in ("checkpoint", "once", "max_batches", "idle_timeout", "max_offsets_per_trigger")
                   if getattr(args, name)]
    if follow_only and not args.follow:
        flags = ", ".join("--" + name.replace("_", "-") for name in follow_only)
        raise UsageError(f"{flags} only go with --follow")
    if args.table_format and not (args.sink or args.latest):
        raise UsageError("--format goes with --sink or --latest")
    if args.tombstones and not args.latest:
        raise UsageError("--tombstones goes with --latest")
    if args.follow and args.sink and args.table_format != "delta":
        raise UsageError("--sink in follow mode needs --format delta (appending to plain Parquet files cannot be "
                         "made exactly once across restarts)")
    if args.follow and args.once and args.max_batches:
        raise UsageError("give --once or --max-batches, not both")
    for key, _ in args.conf:
        if not key.startswith("spark."):
            raise UsageError(f"--conf {key}: Spark settings start with 'spark.'")


class Progress:
    """Log lines a person can follow on a long run: elapsed time and what is happening."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        self.stream.write(f"audit [{time.monotonic() - self.started:7.1f}s] {message}\n")
        self.stream.flush()


def _submitted_jars() -> str:
    """Jars given to spark-submit itself (--jars/--packages), when this runs under spark-submit."""
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        return ""
    from pyspark import SparkConf, SparkContext

    SparkContext._ensure_initialized()  # connects to spark-submit's JVM, whose system properties hold its settings
    conf = SparkConf()
    return ",".join(filter(None, [conf.get("spark.jars", ""), conf.get("spark.jars.packages", "")]))


def main(argv: Sequence[str] | None = None, *, defaults: Defaults | None = None, stdout: TextIO | None = None,
         stderr: TextIO | None = None, prog: str = "python -m outbox.pipeline") -> int:
    """Parse `argv` and run the audit; returns the exit status."""
    stderr = stderr or sys.stderr
    missing = pyspark_missing()
    if missing:
        stderr.write(f"{prog}: error: {missing}\n")
        return reports.EXIT_USAGE
    try:
        args = build_parser(prog).parse_args(argv)
    except UsageError as error:
        stderr.write(f"{prog}: error: {error} (see --help)\n")
        return reports.EXIT_USAGE
    except SystemExit as done:  # --help
        return int(done.code or 0)
    return run(args, defaults=defaults, stdout=stdout, stderr=stderr, prog=prog)


def master_of(args: argparse.Namespace) -> str | None:
    """The master asked for: --master, else spark-submit's (None), else local[*]."""
    return args.master or (None if "PYSPARK_GATEWAY_PORT" in os.environ else DEFAULT_MASTER)


def checkpoint_of(args: argparse.Namespace) -> str | None:
    return (args.checkpoint or str(Path(args.out) / "checkpoint")) if args.follow else None


def check_before_spark(args: argparse.Namespace, defaults: Defaults) -> list[str]:
    """Everything that can be checked before the JVM starts; returns the jars. Raises on the first problem."""
    validate(args, defaults)
    preflight.check_master(master_of(args))
    folders = {"--out": args.out, "--sink": args.sink, "--latest": args.latest, "--checkpoint": checkpoint_of(args)}
    preflight.check_distinct(folders, replaced=("--sink", "--latest"))
    if args.ledger:
        preflight.check_ledger_file(args.ledger)
    for flag, path in folders.items():  # last: this creates the folders
        if path and not preflight.has_scheme(path):
            preflight.check_writable_folder(flag, path)
    if delta(args):
        from outbox.pipeline import delta_table

        missing = delta_table.package_missing()
        if missing:
            raise UsageError(missing)
    submitted = _submitted_jars()
    if "spark-sql-kafka" in submitted:
        if delta(args) and "delta-spark" not in submitted:
            raise jar_lookup.JarsNotFound("--format delta: give spark-submit Delta Lake's jars too (--jars "
                                          "delta-spark_4.2_2.13-*.jar,... or --packages io.delta:delta-spark_4.2_2.13:"
                                          "VERSION)")
        return []
    jar_list = jar_lookup.resolve(args.jars, defaults.spark_jars)
    jar_lookup.check_versions(jar_list, *jar_lookup.pyspark_versions())
    if delta(args):
        jar_lookup.check_delta(jar_list, *jar_lookup.pyspark_versions())
    return jar_list


def delta(args: argparse.Namespace) -> bool:
    """Whether the run writes Delta tables (`--format delta`)."""
    return args.table_format == "delta"


def run(args: argparse.Namespace, *, defaults: Defaults | None = None, stdout: TextIO | None = None,
        stderr: TextIO | None = None, prog: str = "outbox_audit") -> int:
    """Run the audit for parsed arguments; returns the exit status. Errors are one line on `stderr`."""
    defaults = defaults or Defaults()
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    missing = pyspark_missing()
    if missing:
        stderr.write(f"{prog}: error: {missing}\n")
        return reports.EXIT_USAGE
    try:
        jar_list = check_before_spark(args, defaults)
        bootstrap = (args.bootstrap_servers or defaults.bootstrap_servers or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
                     or DEFAULT_BOOTSTRAP_SERVERS)
        security = sources.security_settings(defaults.kafka_config)
        kafka = sources.Kafka(bootstrap, {**sources.java_options(security), **dict(args.kafka_option)}, security)
        partitions = sources.partitions(kafka, args.topics, timeout=args.kafka_timeout)
    except (UsageError, preflight.PreflightError, jar_lookup.JarsNotFound, sources.SourceError) as error:
        stderr.write(f"{prog}: error: {error}\n")
        return reports.EXIT_USAGE
    from outbox.pipeline.ledger import LedgerError
    from outbox.pipeline.state import StateError

    progress = Progress(stderr)

    def stuck(reason: str) -> None:  # called from a watcher thread while Spark blocks the main one
        stderr.write(f"{prog}: error: {reason}\n")
        stderr.flush()
        os._exit(reports.EXIT_USAGE)  # the JVM ends with us: it watches the pipe to this process

    try:
        return _audit(args, defaults, kafka, partitions, jar_list, progress, stdout, stuck)
    except (sources.SourceError, LedgerError, StateError, preflight.PreflightError) as error:
        stderr.write(f"{prog}: error: {error}\n")
        return reports.EXIT_USAGE
    except KeyboardInterrupt:
        stderr.write(f"{prog}: interrupted\n")
        return EXIT_FAILED
    except Exception as error:  # Spark's own failures: one line here, the details are in Spark's log above
        stderr.write(f"{prog}: failed: {_one_line(error)}\n")
        return EXIT_FAILED


def _one_line(error: BaseException) -> str:
    """The first line of an error, with the Java exception's own message when py4j wraps one."""
    java = getattr(error, "java_exception", None)
    text = str(java.toString() if java is not None else error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _run_info(args: argparse.Namespace, kafka: sources.Kafka, started: datetime, master: str | None,
              checkpoint: str | None) -> dict[str, Any]:
    """`run` of the report: the same keys in batch and follow mode (None where a mode has no such thing)."""
    return {"mode": "follow" if args.follow else "batch", "started": started.isoformat(), "seconds": None,
            "master": master, "bootstrap_servers": kafka.bootstrap_servers, "offsets": {},
            "sink": args.sink, "latest": args.latest, "format": args.table_format or "parquet",
            "checkpoint": checkpoint,
            "batches_folded": [], "batches_skipped": [], "stopped": None}


def _start_spark(spark: Any, args: argparse.Namespace, progress: Callable[[str], None]) -> None:
    """After the session is up and before any job: executors on a cluster, its defaults, remote paths."""
    from outbox.pipeline import session

    master = spark.sparkContext.master
    if not preflight.is_local_master(master):
        progress(f"waiting for executors of {master}")
        executors, parallelism = preflight.wait_for_executors(spark, args.executor_timeout)
        applied = session.cluster_defaults(spark, dict(args.conf), parallelism)
        progress(f"{executors} executor(s), default parallelism {parallelism}"
                 + "".join(f"; {key}={value}" for key, value in applied.items()))
    preflight.check_remote_paths(
        spark, {"--sink": args.sink, "--latest": args.latest, "--checkpoint": checkpoint_of(args)},
        {"--ledger": args.ledger})
    note = preflight.note_shared_storage(master, {"--ledger": args.ledger, "--checkpoint": checkpoint_of(args),
                                                  "--sink": args.sink, "--latest": args.latest})
    if note:
        progress(note)


def _audit(args: argparse.Namespace, defaults: Defaults, kafka: sources.Kafka, partitions: dict[str, list[int]],
           jar_list: list[str], progress: Callable[[str], None], stdout: TextIO,
           stuck: Callable[[str], None] | None = None) -> int:
    from outbox.pipeline import audit, session

    started = datetime.now(UTC)
    master = master_of(args)
    table_format = args.table_format or "parquet"
    run_info = _run_info(args, kafka, started, master, checkpoint_of(args))
    offsets = None
    if not args.follow:
        offsets = sources.watermarks(kafka, partitions, timeout=args.kafka_timeout)
        total = sum(high - low for parts in offsets.values() for low, high in parts.values())
        progress(f"{total:,} messages in {len(args.topics)} topic(s), "
                 f"{sum(len(p) for p in partitions.values())} partition(s); offsets pinned")
        run_info["offsets"] = {topic: {str(p): [low, high] for p, (low, high) in parts.items()}
                               for topic, parts in offsets.items()}
    progress(f"starting Spark ({master or 'from spark-submit'})")
    with session.spark_session(master, dict(args.conf), jar_list, on_stuck=stuck, delta=delta(args)) as spark:
        run_info["master"] = spark.sparkContext.master
        if delta(args) and not session.has_delta(spark):
            raise preflight.PreflightError(
                f"--format delta: the running Spark session was started without Delta Lake; start it with "
                f"spark.sql.extensions={session.DELTA_EXTENSION} and "
                f"spark.sql.catalog.spark_catalog={session.DELTA_CATALOG}")
        _start_spark(spark, args, progress)
        ledger_frame, ledger_label = _ledger(spark, args, defaults)
        if args.follow:
            findings = _follow(spark, args, kafka, ledger_frame, ledger_label, run_info, progress, stdout)
        else:
            assert offsets is not None
            batch = audit.normalize(sources.read_batch(spark, kafka, offsets))
            progress("reading the messages and checking them (Spark's stages below)")
            state = audit.fold(None, batch, examples=args.examples, latest=bool(args.latest),
                               whole_partitions=kafka.whole_partitions, topics=args.topics)
            try:
                findings = audit.summarize(state, ledger=ledger_frame, examples=args.examples, progress=progress)
                if args.latest:
                    from outbox.pipeline import latest

                    assert state.latest is not None
                    progress(f"writing each key's newest record to {args.latest}")
                    latest.write(state.latest, args.latest, table_format=table_format,
                                 tombstones=args.tombstones or "delete")
            finally:
                state.release()
            if args.sink:
                progress(f"writing the de-duplicated records to {args.sink}")
                from outbox.pipeline import sink

                sink.write(batch, args.sink, table_format)
            run_info.update(batches_folded=[0], stopped="end of the offsets pinned at start")
    run_info["seconds"] = round((datetime.now(UTC) - started).total_seconds(), 3)
    built = reports.build(findings, args.topics, ledger=ledger_label, run=run_info)
    path = reports.write(built, args.out)
    progress("done")
    stdout.write(reports.summary(built, path) + "\n")
    stdout.flush()
    return reports.exit_code(built)


def _ledger(spark: Any, args: argparse.Namespace, defaults: Defaults) -> tuple[Any, str | None]:
    from outbox.pipeline import ledger

    if args.ledger:
        return ledger.from_file(spark, args.ledger), args.ledger
    if args.ledger_table:
        url = args.ledger_url or defaults.ledger_url
        properties = {**(defaults.ledger_properties if not args.ledger_url else {}), **dict(args.ledger_property)}
        return ledger.from_jdbc(spark, url, args.ledger_table, args.ledger_column, properties), args.ledger_table
    return None, None


def _follow(spark: Any, args: argparse.Namespace, kafka: sources.Kafka, ledger_frame: Any, ledger_label: str | None,
            run_info: dict[str, Any], progress: Callable[[str], None], stdout: TextIO) -> Any:
    from outbox.pipeline import audit
    from outbox.pipeline.follow import FollowOptions, FollowRun, follow

    checkpoint = checkpoint_of(args)
    assert checkpoint is not None
    options = FollowOptions(checkpoint=checkpoint, once=args.once, max_batches=args.max_batches,
                            idle_timeout=args.idle_timeout, trigger_interval=args.trigger_interval,
                            max_offsets_per_trigger=args.max_offsets_per_trigger, examples=args.examples,
                            latest=args.latest, sink=args.sink, table_format=args.table_format or "parquet",
                            tombstones=args.tombstones or "delete")
    newest: list[Any] = []

    def on_state(state: audit.AuditState, offsets: dict[str, Any], run: FollowRun) -> None:
        findings = audit.summarize(state, ledger=ledger_frame, examples=args.examples)
        newest[:] = [findings]
        info = {**run_info, "offsets": offsets, "batches_folded": list(run.folded),
                "batches_skipped": list(run.skipped)}
        built = reports.build(findings, args.topics, ledger=ledger_label, run=info)
        reports.write(built, args.out)
        progress(f"{built['messages']:,} messages so far, {built['duplicates']:,} duplicates, "
                 f"{built['reversals']:,} reversals, {built['missing']:,} missing; report.json updated")

    progress(f"following {', '.join(args.topics)} (checkpoint {checkpoint})")
    state, offsets, run = follow(spark, kafka, args.topics, options, on_state, progress)
    progress(f"stopped: {run.stopped_because}; {len(run.folded)} batch(es) folded, {len(run.skipped)} skipped")
    run_info.update(batches_folded=run.folded, batches_skipped=run.skipped, stopped=run.stopped_because,
                    offsets=offsets)
    if newest and run.folded:
        return newest[0]
    if state is None:
        return audit.Findings(topics={}, latency_ms={"p50": None, "p95": None, "p99": None},
                              examples={kind: [] for kind in audit.EXAMPLE_KINDS})
    return audit.summarize(state, ledger=ledger_frame, examples=args.examples)


if __name__ == "__main__":
    sys.exit(main(prog=os.path.basename(sys.argv[0])))
