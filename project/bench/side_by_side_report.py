"""The side-by-side benchmark's figures: what one measured stretch cost, one line a stretch as the rounds go,
and the table at the end (the median of the rounds, their range, and the harvester's figure over Debezium's)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from project.bench.dbcost import Cost

MIB = 2**20


@dataclass
class Window:
    """One measured stretch: the records it carried and what it cost."""

    records: int
    seconds: float
    #: The whole server: CPU of all its processes, WAL, statements.
    server: Cost
    #: CPU of the relay's own server processes (its sessions; Debezium's walsender).
    backends_cpu: float
    #: The relay's process (and its children): CPU and peak RSS.
    relay_cpu: float
    relay_rss: int
    #: A drain's first to last message.
    first_to_last: float | None = None
    #: Commit-to-receipt, ms, sorted (steady runs with a relay).
    latencies: list[float] | None = None

    def pct(self, p: float) -> float:
        found = self.latencies or [float("nan")]
        return found[min(len(found) - 1, int(p / 100 * len(found)))]

    @property
    def rate(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Report:
    workloads: list[str]
    records: int
    #: (round, workload, who) -> window; who is "harvester", "debezium", or "writers for <relay>": the writers
    #: alone just before the relay ran the workload (a drain: the insert of its backlog).
    windows: dict[tuple[int, str, str], Window] = field(default_factory=dict)

    def add(self, number: int, workload: str, who: str, window: Window, relay: str | None = None) -> None:
        self.windows[(number, workload, f"{who} for {relay}" if relay else who)] = window

    def baseline(self, number: int, workload: str, relay: str) -> Window:
        """The writers alone, measured just before `relay` ran the workload (a drain: the insert it drained)."""
        return self.windows[(number, workload, f"writers for {relay}")]

    @staticmethod
    def line(window: Window, baseline: Window | None = None) -> str:
        """One stretch: the writers alone, a steady run beside its writers alone, or a drain beside its insert."""
        wal = window.server.wal_bytes
        if baseline is None:
            return (f"{window.rate:,.0f} records/s; Postgres CPU {window.server.cpu:.2f} s, WAL {wal / MIB:.1f} MiB "
                    f"({wal / window.records:,.0f} B/record)")
        if window.first_to_last is not None:  # a drain, beside the insert
            return (f"{window.rate:,.0f} records/s from process start ({window.records / window.first_to_last:,.0f} "
                    f"first to last); relay CPU {window.relay_cpu:.2f} s, RSS {window.relay_rss / MIB:.0f} MiB; "
                    f"Postgres CPU {window.server.cpu:.2f} s = {_ratio(window.server.cpu, baseline.server.cpu)} the "
                    f"insert's, the relay's own processes {window.backends_cpu:.2f} s; WAL "
                    f"{wal / window.records:,.0f} B/record = {_ratio(wal, baseline.server.wal_bytes)} the insert's")
        added = window.server.cpu - baseline.server.cpu
        added_wal = wal - baseline.server.wal_bytes
        return (f"p50 {window.pct(50):.1f} / p95 {window.pct(95):.1f} / p99 {window.pct(99):.1f} ms; relay CPU "
                f"{window.relay_cpu:.2f} s, RSS {window.relay_rss / MIB:.0f} MiB; Postgres CPU +{added:.2f} s = "
                f"{_ratio(added, baseline.server.cpu)} the writers' own, the relay's own processes "
                f"{window.backends_cpu:.2f} s; WAL {added_wal / window.records:+,.0f} B/record")

    def rounds(self) -> list[int]:
        return sorted({number for number, _, _ in self.windows})

    def _values(self, workload: str, who: str, value: Callable[[Window, Window], float]) -> list[float]:
        found = []
        for number in self.rounds():
            window = self.windows.get((number, workload, who))
            base_key = (number, workload, f"writers for {who}")
            if window is not None and base_key in self.windows:
                found.append(value(window, self.windows[base_key]))
        return found

    def table(self) -> list[str]:
        """Markdown: a table per workload, the median of the rounds with their range, and the ratio of the
        medians (harvester over Debezium)."""
        lines = [f"Median of {len(self.rounds())} round(s), the range in brackets; the ratio is the harvester's "
                 "median over Debezium's."]
        drain: list[tuple[str, Callable[[Window, Window], float], str]] = [
            ("records/s from process start", lambda w, b: w.rate, "{:,.0f}"),
            ("records/s, first to last message", lambda w, b: w.records / w.first_to_last, "{:,.0f}"),
            ("relay CPU, s", lambda w, b: w.relay_cpu, "{:.2f}"),
            ("relay peak RSS, MiB", lambda w, b: w.relay_rss / MIB, "{:.0f}"),
            ("Postgres CPU, whole server, s", lambda w, b: w.server.cpu, "{:.2f}"),
            ("Postgres CPU over the insert's", lambda w, b: w.server.cpu / b.server.cpu, "{:.2f}x"),
            ("Postgres CPU, the relay's own processes, s", lambda w, b: w.backends_cpu, "{:.2f}"),
            ("WAL, bytes per record", lambda w, b: w.server.wal_bytes / w.records, "{:,.0f}"),
            ("WAL over the insert's", lambda w, b: w.server.wal_bytes / max(b.server.wal_bytes, 1), "{:.2f}x"),
        ]
        steady: list[tuple[str, Callable[[Window, Window], float], str]] = [
            ("commit to receipt p50, ms", lambda w, b: w.pct(50), "{:.1f}"),
            ("commit to receipt p95, ms", lambda w, b: w.pct(95), "{:.1f}"),
            ("commit to receipt p99, ms", lambda w, b: w.pct(99), "{:.1f}"),
            ("relay CPU, s", lambda w, b: w.relay_cpu, "{:.2f}"),
            ("relay peak RSS, MiB", lambda w, b: w.relay_rss / MIB, "{:.0f}"),
            ("Postgres CPU added, whole server, s", lambda w, b: w.server.cpu - b.server.cpu, "{:.2f}"),
            ("Postgres CPU added over the writers' own", lambda w, b: (w.server.cpu - b.server.cpu) / b.server.cpu,
             "{:.2f}x"),
            ("Postgres CPU, the relay's own processes, s", lambda w, b: w.backends_cpu, "{:.2f}"),
            ("WAL added, bytes per record", lambda w, b: (w.server.wal_bytes - b.server.wal_bytes) / w.records,
             "{:,.0f}"),
        ]
        names = (["drain"] if self.records else []) + self.workloads
        for workload in names:
            title = f"drain of {self.records:,} rows" if workload == "drain" else workload
            writers = ""
            if workload != "drain":
                alone = [f"{_spread(found, '{:.2f}')} s before {who}" for who in ("harvester", "debezium")
                         if (found := self._values(workload, who, lambda w, b: b.server.cpu))]
                writers = f" (the writers alone: Postgres CPU {', '.join(alone)})" if alone else ""
            lines += ["", f"**{title}**{writers}", "",
                      "| | harvester | Debezium | harvester / Debezium |", "|---|---|---|---|"]
            for label, value, form in drain if workload == "drain" else steady:
                ours, theirs = self._values(workload, "harvester", value), self._values(workload, "debezium", value)
                ratio = _over(ours, theirs)
                lines.append(f"| {label} | {_spread(ours, form)} | {_spread(theirs, form)} | {ratio} |")
        return lines


def _over(ours: list[float], theirs: list[float]) -> str:
    """The ratio of the medians; none where Debezium's is nothing to divide by (no WAL of its own) or either
    side is negative (less than the writers alone: noise)."""
    if not ours or not theirs:
        return ""
    mine, peer = statistics.median(ours), statistics.median(theirs)
    if peer <= 0 or mine < 0:
        return "n/a"
    if mine > 20 * peer:
        return f"> 20 (Debezium's {peer:.3g})"
    return f"{mine / peer:.2f}"


def _ratio(part: float, whole: float) -> str:
    return f"{part / whole:.2f}x" if whole else "n/a"


def _spread(values: list[float], form: str) -> str:
    if not values:
        return ""
    middle = form.format(statistics.median(values))
    low, high = form.format(min(values)), form.format(max(values))
    return middle if low == high else f"{middle} ({low} to {high})"
