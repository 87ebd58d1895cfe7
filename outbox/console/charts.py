"""Line charts drawn on the server as inline SVG: no JavaScript, no CDN, nothing to build.

A chart is data (series of points over a time span, and marked moments); `render()` turns it into
an <svg> whose colours are CSS variables (templates/admin/outbox/chart_style.html), so the admin's
light and dark themes both read. Up to HOVER_POINTS points of each line carry a <title>, so hovering
shows their values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, tzinfo

from django.utils import timezone
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

WIDTH, HEIGHT = 560, 170
LEFT, RIGHT, TOP, BOTTOM = 52, 10, 10, 22
#: At most this many series are drawn in one chart (the rest are named in a note).
MAX_SERIES = 8
#: At most this many points of a series carry a tooltip (evenly spread, the latest always; two minutes apart over an
#: hour): the page stays small and quick to draw.
HOVER_POINTS = 30
#: Steps of the time axis, in seconds; the first that gives at most 7 ticks is used.
TIME_STEPS = (60, 300, 600, 900, 1800, 3600, 7200, 10800, 14400, 21600, 43200, 86400)


@dataclass(frozen=True)
class Series:
    """One line: (epoch seconds, value) pairs in time order; a None value breaks the line."""

    label: str
    points: list[tuple[float, float | None]]


@dataclass(frozen=True)
class Marker:
    """A moment marked on the time axis (a vertical line), e.g. a replica taking the lead."""

    at: float
    label: str
    #: A mark standing for several moments close together: the last of them.
    until: float | None = None

    @property
    def at_text(self) -> str:
        return clock(self.at) if self.until is None else f"{clock(self.at)}-{clock(self.until)}"


@dataclass(frozen=True)
class Chart:
    title: str
    #: How values are written on the axis and in tooltips: "count", "rate" (per second), "per_minute",
    #: "seconds" or "ms_per_s" (milliseconds per second: time spent, e.g. by the database).
    unit: str
    start: float
    end: float
    series: list[Series]
    markers: list[Marker] = field(default_factory=list)
    #: Said under the chart when some series were left out.
    note: str = ""

    @property
    def empty(self) -> bool:
        return not any(value is not None for s in self.series for _, value in s.points)

    def legend(self) -> list[tuple[int, str]]:
        """(colour index, label) of each series drawn."""
        return [(i % MAX_SERIES + 1, s.label) for i, s in enumerate(self.series[:MAX_SERIES])]

    def svg(self) -> SafeString:
        return render(self)


def nice_ceiling(value: float) -> float:
    """The smallest 1, 2, 4, 6 or 8 times a power of ten that is at least `value` (and at least 1): its
    quarters, the grid lines, are round numbers too."""
    if value <= 1:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 4, 6, 8, 10):
        if step * power >= value:
            return float(step * power)
    return float(10 * power)  # pragma: no cover - the loop always returns


def format_value(value: float, unit: str) -> str:
    if unit == "seconds":
        if value >= 3600:
            return f"{value / 3600:.1f} h"
        if value >= 60:
            return f"{value / 60:.1f} min"
        return f"{value:.0f} s" if value >= 10 or value == 0 else f"{value:.1f} s"
    if unit == "ms_per_s":
        if value >= 1000:
            return f"{value / 1000:.1f} s/s"
        return f"{value:.0f} ms/s" if value >= 10 or value == 0 else f"{value:.1f} ms/s"
    suffix = {"rate": "/s", "per_minute": "/min"}.get(unit, "")
    if value >= 1_000_000:
        text = f"{value / 1_000_000:.1f}M"
    elif value >= 10_000:
        text = f"{value / 1000:.0f}k"
    elif value >= 1000:
        text = f"{value / 1000:.1f}k"
    elif value == int(value):
        text = f"{int(value)}"
    else:
        text = f"{value:.1f}"
    return text + suffix


def clock(epoch: float, zone: tzinfo | None = None) -> str:
    """A moment as the admin shows times: the current time zone (or `zone`), hours and minutes."""
    return datetime.fromtimestamp(epoch, zone or timezone.get_current_timezone()).strftime("%H:%M")


def render(chart: Chart) -> SafeString:
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    span = max(chart.end - chart.start, 1.0)
    zone = timezone.get_current_timezone()
    values = [v for s in chart.series[:MAX_SERIES] for _, v in s.points if v is not None]
    top = nice_ceiling(max(values, default=0.0))

    def x(t: float) -> float:
        return LEFT + (t - chart.start) / span * plot_w

    def y(v: float) -> float:
        return TOP + plot_h - v / top * plot_h

    label = f"{chart.title}, {clock(chart.start, zone)} to {clock(chart.end, zone)}"
    parts = [f'<svg class="outbox-chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
             f'aria-label="{escape(label)}" preserveAspectRatio="xMinYMin meet">']
    for i in range(5):  # horizontal grid and the value axis
        value = top * i / 4
        parts.append(f'<line class="chart-grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(value):.1f}" '
                     f'y2="{y(value):.1f}"/>')
        parts.append(f'<text class="chart-axis" x="{LEFT - 4}" y="{y(value) + 3:.1f}" text-anchor="end">'
                     f'{escape(format_value(value, chart.unit))}</text>')
    step = next((s for s in TIME_STEPS if span / s <= 7), TIME_STEPS[-1])
    tick = math.ceil(chart.start / step) * step
    while tick <= chart.end:
        parts.append(f'<line class="chart-grid" x1="{x(tick):.1f}" x2="{x(tick):.1f}" y1="{TOP}" '
                     f'y2="{TOP + plot_h}"/>')
        parts.append(f'<text class="chart-axis" x="{x(tick):.1f}" y="{HEIGHT - 6}" text-anchor="middle">'
                     f'{clock(tick, zone)}</text>')
        tick += step
    for marker in chart.markers:
        if chart.start <= marker.at <= chart.end:
            parts.append(f'<line class="chart-marker" x1="{x(marker.at):.1f}" x2="{x(marker.at):.1f}" y1="{TOP}" '
                         f'y2="{TOP + plot_h}"><title>{escape(marker.label)} at {escape(marker.at_text)}</title>'
                         f'</line>')
    for index, series in enumerate(chart.series[:MAX_SERIES]):
        colour = index % MAX_SERIES + 1
        for run in _runs(series.points):
            if len(run) == 1:
                t, v = run[0]
                parts.append(f'<circle class="chart-line chart-{colour}" cx="{x(t):.1f}" cy="{y(v):.1f}" r="1.5"/>')
            else:
                path = " ".join(f"{x(t):.0f},{y(v):.0f}" for t, v in run)  # a pixel is fine enough
                parts.append(f'<polyline class="chart-line chart-{colour}" points="{path}"/>')
        for t, v in _hover_points(series.points):  # invisible hover targets carrying the values
            if v is not None:
                parts.append(f'<circle class="chart-point" cx="{x(t):.1f}" cy="{y(v):.1f}" r="3">'
                             f'<title>{escape(series.label)}: {escape(format_value(v, chart.unit))} at '
                             f'{clock(t, zone)}</title></circle>')
    if chart.empty:
        parts.append(f'<text class="chart-axis" x="{LEFT + plot_w / 2:.1f}" y="{TOP + plot_h / 2:.1f}" '
                     f'text-anchor="middle">no samples in this span</text>')
    parts.append("</svg>")
    return mark_safe("".join(parts))  # every text above is escaped


def _hover_points(points: list[tuple[float, float | None]]) -> list[tuple[float, float | None]]:
    """At most HOVER_POINTS of the points, evenly spread, the latest always among them."""
    step = max(1, math.ceil(len(points) / HOVER_POINTS))
    return points[::-1][::step][::-1]


def _runs(points: list[tuple[float, float | None]]) -> list[list[tuple[float, float]]]:
    """The unbroken stretches of a series (None values break it)."""
    runs: list[list[tuple[float, float]]] = [[]]
    for t, v in points:
        if v is None:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append((t, v))
    return [run for run in runs if run]
