"""outbox.console.charts: the SVG line charts of the console, drawn from data alone."""

from __future__ import annotations

import re

from outbox.console.charts import HOVER_POINTS, MAX_SERIES, Chart, Marker, Series, format_value, nice_ceiling, render

START, END = 1_800_000_000.0, 1_800_003_600.0


def chart(*series: Series, markers: list[Marker] | None = None, unit: str = "count") -> str:
    return str(render(Chart("T", unit, START, END, list(series), markers or [])))


def test_the_value_axis_ends_on_a_round_number_whose_quarters_are_round_too():
    assert [nice_ceiling(v) for v in (0, 0.4, 1, 1.2, 3, 5, 17, 45, 1234, 9000)] == [
        1, 1, 1, 2, 4, 6, 20, 60, 2000, 10000]


def test_values_are_written_for_their_unit():
    assert format_value(1400, "rate") == "1.4k/s" and format_value(25_000, "count") == "25k"
    assert format_value(2_500_000, "count") == "2.5M" and format_value(0.5, "per_minute") == "0.5/min"
    assert format_value(90, "seconds") == "1.5 min" and format_value(7200, "seconds") == "2.0 h"
    assert format_value(4, "seconds") == "4.0 s"


def test_a_line_breaks_where_a_value_is_missing():
    svg = chart(Series("a", [(START + 60, 1.0), (START + 120, 2.0), (START + 180, None), (START + 240, 3.0),
                              (START + 300, 4.0)]))
    assert svg.count("<polyline") == 2


def test_a_lone_point_is_a_dot():
    svg = chart(Series("a", [(START + 60, 1.0), (START + 120, None), (START + 180, 2.0)]))
    assert svg.count('<circle class="chart-line') == 2 and "<polyline" not in svg


def test_labels_are_escaped():
    svg = chart(Series("<script>x</script>", [(START + 60, 1.0), (START + 120, 2.0)]),
                markers=[Marker(START + 90, '"><img src=x>')])
    assert "<script>" not in svg and "<img" not in svg and "&lt;script&gt;" in svg


def test_markers_outside_the_span_are_left_out():
    svg = chart(Series("a", [(START + 60, 1.0)]), markers=[Marker(START - 10, "before"), Marker(START + 5, "in")])
    assert svg.count('class="chart-marker"') == 1 and "in at" in svg


def test_tooltips_are_bounded_and_the_latest_point_has_one():
    points = [(START + 10 * i, float(i)) for i in range(360)]
    svg = chart(Series("a", points))
    tips = re.findall(r'<circle class="chart-point"[^>]*><title>a: ([^<]*) at', svg)
    assert len(tips) <= HOVER_POINTS and tips[-1] == "359"


def test_at_most_max_series_lines_are_drawn():
    many = [Series(f"r{i}", [(START + 60, 1.0), (START + 120, 1.0)]) for i in range(MAX_SERIES + 3)]
    assert chart(*many).count("<polyline") == MAX_SERIES
    assert len(Chart("T", "count", START, END, many).legend()) == MAX_SERIES


def test_an_empty_chart_says_so():
    assert "no samples in this span" in chart(Series("a", [(START + 60, None)]))
