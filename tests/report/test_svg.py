"""The SVG charts: scales and ticks, escaping, gaps and empty data, and that every chart is well-formed XML."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest

from flywheel.report.svg import (
    Bar,
    IntervalRow,
    Layer,
    LinearScale,
    Mark,
    RefLine,
    Series,
    bar_chart,
    escape,
    format_tick,
    interval_chart,
    line_chart,
    nice_ticks,
    stacked_chart,
)

NS = {"s": "http://www.w3.org/2000/svg"}


def parse(svg: str) -> ET.Element:
    """The chart as XML: fails on anything unescaped or unclosed."""
    return ET.fromstring(svg)


def by_class(root: ET.Element, css_class: str) -> list[ET.Element]:
    return [e for e in root.iter() if css_class in e.get("class", "").split()]


@pytest.mark.parametrize(("low", "high", "count"), [(0, 1, 5), (0.013, 0.087, 5), (-3.2, 7.9, 4), (1010, 1060, 5),
                                                    (1e-6, 3e-6, 5), (-0.09, -0.01, 5), (0, 123456, 6)])
def test_ticks_are_round_evenly_spaced_and_cover_the_data(low, high, count):
    ticks = nice_ticks(low, high, count)
    assert ticks[0] <= low and ticks[-1] >= high
    steps = {round(b - a, 12) for a, b in zip(ticks, ticks[1:], strict=False)}
    assert len(steps) == 1
    step = steps.pop()
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert any(math.isclose(mantissa, m) for m in (1, 2, 2.5, 5))
    assert count // 2 <= len(ticks) - 1 <= 2 * count + 1
    assert all(repr(t) == repr(float(f"{t:.12g}")) for t in ticks)  # no 0.30000000000000004


def test_a_flat_range_is_widened_and_non_finite_bounds_are_refused():
    assert nice_ticks(0.5, 0.5)[0] < 0.5 < nice_ticks(0.5, 0.5)[-1]
    assert nice_ticks(0, 0)[0] < 0 < nice_ticks(0, 0)[-1]
    with pytest.raises(ValueError, match="finite"):
        nice_ticks(0, math.nan)


def test_scale_maps_the_domain_onto_the_range_and_inverts_for_y():
    y = LinearScale((0.0, 1.0), (200.0, 20.0))  # y grows upwards on screen
    assert y(0.0) == 200 and y(1.0) == 20 and y(0.5) == 110
    assert LinearScale((2.0, 2.0), (0.0, 10.0))(2.0) == 5.0
    assert format_tick(0.25, 0.25) == "0.25" and format_tick(1500, 500) == "1,500" and format_tick(0.4, 0.2) == "0.4"


def test_points_are_placed_by_value_with_their_data():
    svg = line_chart("t", [Series("a", [(0, 0.0), (5, 0.5), (10, 1.0)])], y_range=(0, 1))
    points = by_class(parse(svg), "point")
    assert [(p.get("data-x"), p.get("data-y")) for p in points] == [("0", "0"), ("5", "0.5"), ("10", "1")]
    xs, ys = [float(p.get("cx")) for p in points], [float(p.get("cy")) for p in points]
    assert xs[0] < xs[1] < xs[2] and ys[0] > ys[1] > ys[2]  # higher values are drawn higher
    assert math.isclose(xs[1] - xs[0], xs[2] - xs[1]) and math.isclose(ys[0] - ys[1], ys[1] - ys[2])


def test_text_is_escaped_everywhere():
    evil = '<script>alert("x")</script> & co'
    charts = [
        line_chart(evil, [Series(evil, [(0, 1), (1, 2)], band=[(0, 0, 2), (1, 1, 3)])], x_label=evil, y_label=evil,
                   marks=[Mark(1, 2, evil, kind=evil)], ref_lines=[RefLine(1.5, evil)]),
        interval_chart(evil, [IntervalRow(evil, 0.1, 0.0, 0.2, tooltip=evil, tick=-0.05, tick_label=evil)],
                       x_label=evil),
        bar_chart(evil, [Bar(evil, 3.0, tooltip=evil)], x_label=evil, y_label=evil),
        line_chart(evil, [], empty_message=evil),
    ]
    for svg in charts:
        assert "<script" not in svg
        root = parse(svg)
        texts = [t for e in root.iter() for t in (e.text or "", *e.attrib.values())]
        assert any(evil in t for t in texts)  # shown as text, intact
    assert escape('a"b') == "a&quot;b"


@pytest.mark.parametrize("chart", [
    lambda: line_chart("nothing", []),
    lambda: line_chart("no points", [Series("a", [])]),
    lambda: line_chart("all NaN", [Series("a", [(0, math.nan), (1, None), (math.inf, 1.0)])]),
    lambda: interval_chart("nothing", []),
    lambda: bar_chart("nothing", [Bar("0", None), Bar("1", math.nan)]),
    lambda: stacked_chart("nothing", [1, 2], [Layer("a", [None, math.nan]), Layer("b", [0.0, -1.0])]),
])
def test_no_finite_data_says_no_data_yet(chart):
    root = parse(chart())
    assert [e.text for e in by_class(root, "empty")] == ["no data yet"]
    assert not by_class(root, "point") and not by_class(root, "bar")


def test_a_missing_value_breaks_the_line_instead_of_joining_across():
    svg = line_chart("gap", [Series("a", [(0, 1.0), (1, 2.0), (2, math.nan), (3, None), (4, 1.5), (5, 1.0)])])
    root = parse(svg)
    (line,) = by_class(root, "line")
    assert line.get("d").count("M") == 2 and line.get("data-points") == "4"
    assert len(by_class(root, "point")) == 4


def test_bands_marks_and_legend():
    svg = line_chart("held-out", [Series("run", [(0, 0.3), (1, 0.4), (2, 0.5)],
                                         band=[(0, 0.2, 0.4), (1, None, None), (2, 0.4, 0.6)])],
                     marks=[Mark(1, 0.4, "edit rate fell"), Mark(2, 0.5, "warned", kind="warning")])
    root = parse(svg)
    assert len(by_class(root, "band")) == 2  # the band breaks where its interval is unknown
    assert len(by_class(root, "alarm")) == 1 and len(by_class(root, "warning")) == 1
    legend = " ".join(t.text or "" for t in by_class(root, "legend")[0].iter("{http://www.w3.org/2000/svg}text"))
    assert "run" in legend and "alarm" in legend and "warning" in legend


def test_interval_rows_ticks_and_uncomputed_rows():
    rows = [IntervalRow("pass_rate", 0.01, -0.03, 0.05, tick=-0.05, tick_label="−margin"),
            IntervalRow("valid calls", -0.04, -0.09, -0.01, tick=-0.08),
            IntervalRow("too few tasks", None)]
    root = parse(interval_chart("gate", rows))
    intervals = by_class(root, "interval")
    assert len(intervals) == 2 and len(by_class(root, "estimate")) == 2 and len(by_class(root, "tick-mark")) == 2
    assert [e.text for e in by_class(root, "no-estimate")] == ["not computed"]
    first, second = ([float(e.get(k)) for k in ("x1", "x2")] for e in intervals)
    assert first[0] < first[1] and second[1] < first[1]  # -0.01 is left of 0.05
    (zero,) = by_class(root, "ref")
    assert first[0] < float(zero.get("x1")) < first[1]


def test_interval_rows_without_values_still_show_their_labels():
    root = parse(interval_chart("gate", [IntervalRow("pass_rate", None), IntervalRow("calls", None, 0.1, None)]))
    assert [e.text for e in by_class(root, "no-estimate")] == ["not computed"] * 2
    assert [e.text for e in by_class(root, "row-label")] == ["pass_rate", "calls"]
    assert not by_class(root, "empty") and not by_class(root, "interval")


def test_bars_grow_from_zero_in_proportion_to_their_values():
    root = parse(bar_chart("tokens", [Bar("0", 300.0), Bar("1", 100.0), Bar("2", -50.0), Bar("3", None)]))
    bars = {b.get("data-label"): b for b in by_class(root, "bar")}
    assert set(bars) == {"0", "1", "2"}
    heights = {k: float(b.get("height")) for k, b in bars.items()}
    assert math.isclose(heights["0"] / heights["1"], 3.0, rel_tol=1e-3)
    assert math.isclose(heights["0"] / heights["2"], 6.0, rel_tol=1e-3)
    assert float(bars["2"].get("y")) >= float(bars["0"].get("y")) + heights["0"] - 0.01  # below the zero line


def test_stacked_bars_pile_each_steps_parts_in_order_to_its_total():
    root = parse(stacked_chart("seconds", [1, 2, 3], [Layer("wait", [2.0, 1.0, None]), Layer("train", [1.0, 3.0, 4.0]),
                                                      Layer("never", [0.0, 0.0, 0.0])]))
    rects = by_class(root, "stacked")
    assert [(r.get("data-x"), r.get("data-series"), float(r.get("data-value"))) for r in rects] == [
        ("1", "wait", 2.0), ("1", "train", 1.0), ("2", "wait", 1.0), ("2", "train", 3.0), ("3", "train", 4.0)]
    # each layer sits on the one below it, heights in proportion to the values
    wait, train = rects[0], rects[1]
    assert math.isclose(float(train.get("y")) + float(train.get("height")), float(wait.get("y")), abs_tol=0.02)
    assert math.isclose(float(wait.get("height")) / float(train.get("height")), 2.0, rel_tol=1e-3)
    assert math.isclose(float(rects[4].get("height")), float(rects[2].get("height")) + float(rects[3].get("height")),
                        abs_tol=0.05)  # step 3's 4 s is as tall as step 2's 1 + 3
    assert "never" not in ET.tostring(by_class(root, "legend")[0], encoding="unicode")  # an all-zero layer
