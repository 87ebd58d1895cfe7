"""`queue_bench compare`'s parts that need no server: the broker's CPU, the peer harness's command line and
printed lines, and the side-by-side table.

The peer is kafka-mq-go (splunk/kafka-mq-go), driven by a small Go harness built outside this repository
(docs/benchmarks.md, "Queue backends side by side", says how). The harness prints lines starting with
"kmq-harness ", a kind, then key=value pairs (a value with spaces is double-quoted):

    kmq-harness ready consumers=4
    kmq-harness stretch-start
    kmq-harness throughput consumers=4 handler_ms=10 messages=2000 seconds=5.123 send_seconds=0.051 duplicates=0
    kmq-harness kill run=1
    kmq-harness redelivery run=1 seconds=2.051
    kmq-harness error message="only 10 of 2000 messages handled within 10m0s"
"""

from __future__ import annotations

import os
import shlex
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import psutil

PEERS = ("kafka-mq-go",)
HARNESS_PREFIX = "kmq-harness"
BACKENDS = ("markers", "share", "kafka-mq-go")


class HarnessError(Exception):
    """The harness printed an error line, or a line queue_bench cannot read."""


# -- the broker's CPU -------------------------------------------------------------------------------------


def bootstrap_port(servers: str) -> int:
    """The port of the first of `servers` ("host:port,host:port", IPv6 as "[::1]:9092")."""
    first = servers.split(",")[0].strip()
    if "://" in first:
        first = first.split("://", 1)[1]
    host, sep, port = first.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"no port in bootstrap server {first!r}")
    return int(port)


def listening_pid(port: int, connections: Iterable[object] | None = None) -> int | None:
    """The pid of the process listening on TCP `port` on this machine (None: none, or not ours to see)."""
    if connections is None:
        try:
            connections = psutil.net_connections(kind="tcp")
        except psutil.AccessDenied:
            return None
    for conn in connections:
        laddr = getattr(conn, "laddr", None)
        if getattr(conn, "status", None) == psutil.CONN_LISTEN and laddr and laddr.port == port and conn.pid:
            return int(conn.pid)
    return None


@dataclass(frozen=True)
class Usage:
    """What the broker's process used: CPU seconds (user + system) and bytes it wrote to storage (Linux counts a
    page cache write when the page is dirtied, so a write not yet flushed counts too)."""

    cpu: float
    written: int

    def __sub__(self, other: Usage) -> Usage:
        return Usage(self.cpu - other.cpu, self.written - other.written)

    def per_second(self, seconds: float) -> Usage:
        return Usage(self.cpu / seconds, round(self.written / seconds))


class Broker:
    """The Kafka broker listening on the bootstrap port, when it runs on this machine."""

    def __init__(self, servers: str) -> None:
        self.pid = listening_pid(bootstrap_port(servers))
        self.process = psutil.Process(self.pid) if self.pid else None

    def usage(self) -> Usage | None:
        if self.process is None:
            return None
        try:
            times, io = self.process.cpu_times(), self.process.io_counters()
        except (psutil.Error, AttributeError):  # AttributeError: no io_counters on this platform
            return None
        return Usage(times.user + times.system, io.write_bytes)


def used(before: Usage | None, after: Usage | None) -> Usage | None:
    """What was used between two readings (None when either could not be read)."""
    if before is None or after is None:
        return None
    return after - before


def load_average() -> float:
    return os.getloadavg()[0]


# -- the peer harness ---------------------------------------------------------------------------------------


def harness_throughput_argv(binary: str, *, bootstrap: str, messages: int, consumers: int, handler_ms: int,
                            redelivery_timeout: float, payload_bytes: int, partitions: int,
                            extra: Sequence[str] = ()) -> list[str]:
    return [binary, "throughput", "-bootstrap", bootstrap, "-messages", str(messages), "-consumers", str(consumers),
            "-handler-ms", str(handler_ms), "-redelivery-timeout", _go_duration(redelivery_timeout),
            "-payload-bytes", str(payload_bytes), "-partitions", str(partitions), *extra]


def harness_redelivery_argv(binary: str, *, bootstrap: str, runs: int, redelivery_timeout: float,
                            extra: Sequence[str] = ()) -> list[str]:
    return [binary, "redelivery", "-bootstrap", bootstrap, "-runs", str(runs),
            "-redelivery-timeout", _go_duration(redelivery_timeout), *extra]


def _go_duration(seconds: float) -> str:
    """Seconds as Go's time.ParseDuration reads them: 2 -> "2000ms", 0.5 -> "500ms"."""
    if seconds <= 0:
        raise ValueError(f"a redelivery timeout must be positive, got {seconds!r}")
    return f"{round(seconds * 1000)}ms"


@dataclass(frozen=True)
class HarnessLine:
    kind: str
    fields: dict[str, str]

    def number(self, key: str) -> float:
        try:
            return float(self.fields[key])
        except KeyError:
            raise HarnessError(f"the harness's {self.kind!r} line has no {key}=") from None
        except ValueError:
            raise HarnessError(f"the harness's {key}={self.fields[key]!r} is not a number") from None


def parse_harness_line(line: str) -> HarnessLine | None:
    """One line of the harness's stdout: None for lines not its own (librdkafka's, say); HarnessError for an
    error line or a line of its own that cannot be read."""
    if not line.startswith(HARNESS_PREFIX + " "):
        return None
    try:
        words = shlex.split(line[len(HARNESS_PREFIX) + 1:])
    except ValueError as exc:
        raise HarnessError(f"unreadable harness line {line.strip()!r}: {exc}") from None
    if not words or "=" in words[0]:
        raise HarnessError(f"a harness line without a kind: {line.strip()!r}")
    fields = {}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise HarnessError(f"not key=value in harness line {line.strip()!r}: {word!r}")
        fields[key] = value
    parsed = HarnessLine(words[0], fields)
    if parsed.kind == "error":
        raise HarnessError(f"kafka-mq-go harness: {fields.get('message', line.strip())}")
    return parsed


# -- results and the table ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Throughput:
    """One send-receive-handle-ack run: `seconds` from the first send to the last ack; the broker used `broker`
    over `stretch` wall seconds (the first send to all handled; None: not readable)."""

    backend: str
    consumers: int
    handler_ms: int
    messages: int
    seconds: float
    broker: Usage | None
    stretch: float
    load: float

    @property
    def rate(self) -> float:
        return self.messages / self.seconds

    def per_1000(self, idle: Usage | None = None) -> Usage | None:
        """The broker's use per 1,000 messages; less `idle` (a use per second) over the stretch when given."""
        if self.broker is None or self.messages <= 0:
            return None
        spent = self.broker - Usage(idle.cpu * self.stretch, round(idle.written * self.stretch)) if idle \
            else self.broker
        return Usage(spent.cpu / self.messages * 1000, round(spent.written / self.messages * 1000))

    def cell(self, idle: Usage | None = None) -> str:
        per = self.per_1000()
        if per is None:
            broker = "broker n/a"
        else:
            broker = f"broker {per.cpu:.2f} CPU s, {per.written / 1e6:.1f} MB written /1k"
            net = self.per_1000(idle) if idle else None
            if net is not None:
                broker += f" ({net.cpu:.2f} CPU s, {net.written / 1e6:.1f} MB above idle)"
        return f"{self.rate:,.0f} msg/s; {broker}; load {self.load:.1f}"


@dataclass(frozen=True)
class Kills:
    backend: str
    seconds: list[float] = field(default_factory=list)
    load: float = 0.0

    def cell(self) -> str:
        each = ", ".join(f"{s:.2f}" for s in self.seconds)
        return f"{each} s (median {statistics.median(self.seconds):.2f}); load {self.load:.1f}"


def format_table(throughputs: Sequence[Throughput], kills: Sequence[Kills], *, backends: Sequence[str],
                 redelivery_timeout: float, idle: Usage | None = None) -> str:
    """One Markdown table: a row per (consumers, handler) and one for the SIGKILLs; a column per backend."""
    lines = ["| send, receive, handle, ack | " + " | ".join(backends) + " |",
             "|---" * (len(backends) + 1) + "|"]
    scenarios: list[tuple[int, int, int]] = []
    for t in throughputs:
        if (t.consumers, t.handler_ms, t.messages) not in scenarios:
            scenarios.append((t.consumers, t.handler_ms, t.messages))
    for consumers, handler_ms, messages in scenarios:
        label = (f"{consumers} consumer{'s' if consumers != 1 else ''}, "
                 f"{'no-op' if handler_ms == 0 else f'{handler_ms} ms'} handler ({messages:,} messages)")
        cells = []
        for backend in backends:
            found = [t for t in throughputs if (t.backend, t.consumers, t.handler_ms, t.messages)
                     == (backend, consumers, handler_ms, messages)]
            cells.append(found[0].cell(idle) if found else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if kills:
        runs = max(len(k.seconds) for k in kills)
        cells = [next((k.cell() for k in kills if k.backend == backend), "") for backend in backends]
        lines.append(f"| SIGKILL to handled elsewhere ({runs} runs, redelivery timeout / lock "
                     f"{redelivery_timeout:g} s) | " + " | ".join(cells) + " |")
    if idle is not None:
        lines.append(f"\nThe broker while no benchmark ran (others' traffic on a shared broker): "
                     f"{idle.cpu:.3f} CPU s/s, {idle.written / 1e3:,.0f} kB/s written; \"above idle\" takes that much "
                     f"off each stretch.")
    return "\n".join(lines)
