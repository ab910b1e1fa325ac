"""Charts as inline SVG strings: a line chart (with bands and marks), an interval chart, a bar chart,
a stacked bar chart.

    svg = line_chart("Held-out pass rate", [Series("run", [(0, 0.2), (10, 0.4)], band=[(0, 0.1, 0.3), ...])],
                     x_label="step", y_range=(0, 1))

Why not a plotting library: the report must open offline and the dashboard must redraw on every
poll, so each chart is one self-contained `<svg>` string, built in Python with no dependency and no
script. The cost is a small feature set: linear axes only, no zoom; hover a point for its values
(each data mark has a `<title>`).

Every piece of text (titles, labels, series names, tooltips) goes through `escape`, so a name like
`<script>` is shown, never run. Values that are None or not finite (NaN from a diverged step) are
left out; a line breaks at them rather than joining across. A chart without any finite value is
`empty_chart`: its title and "no data yet".

Data marks carry classes, which the tests and the dashboard test read back from the DOM:
`circle.point` (a data point, with data-series, data-x, data-y), `path.line`, `path.band`,
`rect.bar`, `rect.stacked` (with data-series, data-x, data-value), `line.interval`, `path.mark`
(an event such as an alarm, plus its own class), `text.empty` (a chart with no data).
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeGuard

# Tableau 10: distinguishable, and readable by most colour-blind viewers.
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac")
GOOD, BAD, WARN, NEUTRAL, MUTED = "#59a14f", "#e15759", "#f28e2b", "#4e79a7", "#9a9a9a"
WIDTH, HEIGHT = 560, 260
_FONT = 'font-family="system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif" font-size="11"'
_CHAR_W = 6.2  # approximate width of an 11 px character, for laying out labels without measuring text
_MAX_MARKERS = 400  # more points than this per series: the line only, no circles (keeps the SVG small)


def escape(text: object) -> str:
    """Text safe inside an element or a quoted attribute."""
    return html.escape(str(text), quote=True)


def finite(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# ---- scales and ticks


def nice_step(span: float, count: int) -> float:
    """A round step (1, 2, 2.5 or 5 times a power of ten) giving about `count` intervals over `span`."""
    raw = span / max(count, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    for multiple in (1, 2, 2.5, 5, 10):
        if multiple * magnitude >= raw * (1 - 1e-9):
            return multiple * magnitude
    return 10 * magnitude


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values whose first is <= low and last is >= high (a flat range is widened)."""
    if not (finite(low) and finite(high)):
        raise ValueError(f"ticks need finite bounds, got {low!r} and {high!r}; drop non-finite values first")
    low, high = min(low, high), max(low, high)
    if high == low:
        pad = abs(low) * 0.1 or 1.0
        low, high = low - pad, high + pad
    step = nice_step(high - low, count)
    first, last = math.floor(low / step + 1e-9), math.ceil(high / step - 1e-9)
    return [_clean(i * step) for i in range(first, last + 1)]


def _clean(value: float) -> float:
    """0.30000000000000004 -> 0.3, and -0.0 -> 0.0."""
    return float(f"{value:.12g}") + 0.0


def format_tick(value: float, step: float) -> str:
    """`value` with as many decimals as `step` needs (step 0.25: two), thousands separated."""
    decimals = 0
    while decimals < 6 and abs(round(step, decimals) - step) > 1e-9 * max(abs(step), 1e-300):
        decimals += 1
    return f"{value:,.{decimals}f}"


def format_value(value: float | None, digits: int = 3) -> str:
    """A value for a tooltip or a table: three significant digits, or an em dash."""
    if not finite(value):
        return "—"
    return f"{value:,.{digits}g}" if abs(value) < 1e5 else f"{value:,.0f}"


@dataclass(frozen=True)
class LinearScale:
    """Maps the interval `domain` onto `range` (pixels); a flat domain maps to the middle."""

    domain: tuple[float, float]
    range: tuple[float, float]

    def __call__(self, value: float) -> float:
        (d0, d1), (r0, r1) = self.domain, self.range
        if d1 == d0:
            return (r0 + r1) / 2
        return r0 + (value - d0) * (r1 - r0) / (d1 - d0)


# ---- what charts are made of


@dataclass(frozen=True)
class Series:
    """A line: (x, y) points in x order (y None: a gap), an optional band (x, low, high) drawn under it."""

    name: str
    points: Sequence[tuple[float, float | None]]
    band: Sequence[tuple[float, float | None, float | None]] = ()
    color: str | None = None  # None: the next palette colour
    markers: bool = True
    dashed: bool = False


@dataclass(frozen=True)
class Mark:
    """An event at a point, drawn as a triangle on top of the lines (e.g. a monitor alarm)."""

    x: float
    y: float
    label: str  # the tooltip
    color: str = BAD
    kind: str = "alarm"  # its class, and its legend entry


@dataclass(frozen=True)
class RefLine:
    """A reference value drawn across the plot (y for line charts, x for interval charts)."""

    value: float
    label: str = ""
    color: str = MUTED


@dataclass(frozen=True)
class IntervalRow:
    """One row of an interval chart: an estimate with its interval and an optional per-row tick."""

    label: str
    estimate: float | None
    low: float | None = None
    high: float | None = None
    color: str = NEUTRAL
    tooltip: str = ""
    tick: float | None = None  # e.g. -margin of a gate check
    tick_label: str = ""


@dataclass(frozen=True)
class Bar:
    label: str
    value: float | None
    color: str | None = None
    tooltip: str = ""


@dataclass(frozen=True)
class Layer:
    """One layer of a stacked chart: a value for each x (None or not finite: nothing there)."""

    name: str
    values: Sequence[float | None]
    color: str | None = None  # None: the next palette colour


@dataclass
class _Frame:
    """The chart's box: margins around the plot area, and the SVG being written."""

    title: str
    width: int
    height: int
    left: float = 56
    right: float = 16
    top: float = 30
    bottom: float = 40
    parts: list[str] = field(default_factory=list)

    @property
    def plot(self) -> tuple[float, float, float, float]:  # x0, y0 (top), x1, y1 (bottom)
        return self.left, self.top, self.width - self.right, self.height - self.bottom

    def svg(self, css_class: str) -> str:
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" class="chart {css_class}" viewBox="0 0 {self.width} '
                f'{self.height}" width="{self.width}" height="{self.height}" role="img" '
                f'aria-label="{escape(self.title)}" {_FONT}>')
        title = (f'<title>{escape(self.title)}</title><text class="chart-title" x="10" y="16" '
                 f'font-size="13" font-weight="600" fill="#222">{escape(self.title)}</text>')
        return head + title + "".join(self.parts) + "</svg>"


def _n(value: float) -> str:
    """A pixel coordinate: two decimals are sub-pixel exact and keep the SVG short."""
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _axis_label(frame: _Frame, x_label: str, y_label: str) -> None:
    x0, y0, x1, y1 = frame.plot
    if x_label:
        frame.parts.append(f'<text class="axis-label" x="{_n((x0 + x1) / 2)}" y="{frame.height - 6}" '
                           f'text-anchor="middle" fill="#444">{escape(x_label)}</text>')
    if y_label:
        frame.parts.append(f'<text class="axis-label" transform="translate(12 {_n((y0 + y1) / 2)}) rotate(-90)" '
                           f'text-anchor="middle" fill="#444">{escape(y_label)}</text>')


def _x_axis(frame: _Frame, scale: LinearScale, ticks: list[float], grid: bool = False) -> None:
    x0, y0, x1, y1 = frame.plot
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    frame.parts.append(f'<line class="axis" x1="{_n(x0)}" y1="{_n(y1)}" x2="{_n(x1)}" y2="{_n(y1)}" stroke="#888"/>')
    for t in ticks:
        x = scale(t)
        if grid:
            frame.parts.append(f'<line class="grid" x1="{_n(x)}" y1="{_n(y0)}" x2="{_n(x)}" y2="{_n(y1)}" '
                               f'stroke="#eee"/>')
        frame.parts.append(f'<line x1="{_n(x)}" y1="{_n(y1)}" x2="{_n(x)}" y2="{_n(y1 + 4)}" stroke="#888"/>'
                           f'<text class="tick" x="{_n(x)}" y="{_n(y1 + 15)}" text-anchor="middle" fill="#555">'
                           f'{escape(format_tick(t, step))}</text>')


def _y_axis(frame: _Frame, scale: LinearScale, ticks: list[float]) -> None:
    x0, y0, x1, y1 = frame.plot
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    frame.parts.append(f'<line class="axis" x1="{_n(x0)}" y1="{_n(y0)}" x2="{_n(x0)}" y2="{_n(y1)}" stroke="#888"/>')
    for t in ticks:
        y = scale(t)
        frame.parts.append(f'<line class="grid" x1="{_n(x0)}" y1="{_n(y)}" x2="{_n(x1)}" y2="{_n(y)}" stroke="#eee"/>'
                           f'<text class="tick" x="{_n(x0 - 6)}" y="{_n(y + 4)}" text-anchor="end" fill="#555">'
                           f'{escape(format_tick(t, step))}</text>')


def _legend(frame: _Frame, entries: Sequence[tuple[str, str, str]]) -> None:
    """Swatches under the title, wrapped to the chart's width; moves the plot down to make room.

    entries: (label, colour, shape) with shape "line" or "triangle"."""
    if not entries:
        return
    x, y, rows = frame.left, 30.0, 1
    items = []
    for label, color, shape in entries:
        w = 22 + len(label) * _CHAR_W + 12
        if x + w > frame.width - frame.right and x > frame.left:
            x, y, rows = frame.left, y + 15, rows + 1
        swatch = (f'<path d="M{_n(x + 5)} {_n(y - 8)} L{_n(x + 10)} {_n(y)} L{_n(x)} {_n(y)} Z" fill="{color}"/>'
                  if shape == "triangle" else
                  f'<line x1="{_n(x)}" y1="{_n(y - 4)}" x2="{_n(x + 16)}" y2="{_n(y - 4)}" stroke="{color}" '
                  f'stroke-width="2.5"/>')
        items.append(f'{swatch}<text x="{_n(x + 20)}" y="{_n(y)}" fill="#333">{escape(label)}</text>')
        x += w
    frame.parts.append('<g class="legend">' + "".join(items) + "</g>")
    frame.top += 15 * rows + 4


def empty_chart(title: str, message: str = "no data yet", width: int = WIDTH, height: int = 110) -> str:
    frame = _Frame(title, width, height)
    frame.parts.append(f'<rect x="1" y="26" width="{width - 2}" height="{height - 32}" fill="#fafafa" '
                       f'stroke="#ddd" stroke-dasharray="4 3"/>'
                       f'<text class="empty" x="{width / 2}" y="{(height + 26) / 2 + 4}" text-anchor="middle" '
                       f'fill="#888" font-size="13">{escape(message)}</text>')
    return frame.svg("empty-chart")


def _paths(points: Iterable[tuple[float, float]], gaps: Iterable[bool]) -> str:
    """An SVG path through the points, lifting the pen where a gap precedes a point."""
    parts, pen_down = [], False
    for (x, y), gap in zip(points, gaps, strict=True):
        if gap:
            pen_down = False
            continue
        parts.append(f"{'L' if pen_down else 'M'}{_n(x)} {_n(y)}")
        pen_down = True
    return " ".join(parts)


def _segments(rows: Sequence[tuple[float, ...]]) -> list[list[tuple[float, ...]]]:
    """Runs of rows whose values are all finite (a band is drawn per run)."""
    runs: list[list[tuple[float, ...]]] = [[]]
    for row in rows:
        if all(finite(v) for v in row):
            runs[-1].append(row)
        elif runs[-1]:
            runs.append([])
    return [r for r in runs if r]


def line_chart(title: str, series: Sequence[Series], *, x_label: str = "", y_label: str = "",
               marks: Sequence[Mark] = (), ref_lines: Sequence[RefLine] = (),
               y_range: tuple[float, float] | None = None, width: int = WIDTH, height: int = HEIGHT,
               empty_message: str = "no data yet") -> str:
    """Lines over a shared x axis, each with optional band and point markers; marks and reference lines on top.

    `y_range` is the least y extent shown (e.g. (0, 1) for a rate); data outside it widens the axis."""
    xs = [x for s in series for x, y in s.points if finite(x) and finite(y)]
    ys = [y for s in series for x, y in s.points if finite(x) and finite(y)]
    xs += [x for s in series for x, lo, hi in s.band if finite(x) and finite(lo) and finite(hi)]
    ys += [v for s in series for x, lo, hi in s.band if finite(x) and finite(lo) and finite(hi) for v in (lo, hi)]
    if not xs:
        return empty_chart(title, empty_message, width)
    xs += [m.x for m in marks if finite(m.x) and finite(m.y)]
    ys += [m.y for m in marks if finite(m.x) and finite(m.y)] + [r.value for r in ref_lines if finite(r.value)]
    if y_range is not None:
        ys += list(y_range)
    frame = _Frame(title, width, height)
    colors = [s.color or PALETTE[i % len(PALETTE)] for i, s in enumerate(series)]
    legend = [(s.name, c, "line") for s, c in zip(series, colors, strict=True) if len(series) > 1 or s.band]
    legend += [(kind, next(m.color for m in marks if m.kind == kind), "triangle")
               for kind in dict.fromkeys(m.kind for m in marks)]
    _legend(frame, legend)
    x0, y0, x1, y1 = frame.plot
    x_ticks = nice_ticks(min(xs), max(xs)) if min(xs) != max(xs) else [min(xs)]
    y_ticks = nice_ticks(min(ys), max(ys))
    x_domain = (x_ticks[0], x_ticks[-1]) if len(x_ticks) > 1 else (x_ticks[0] - 1, x_ticks[0] + 1)
    sx, sy = LinearScale(x_domain, (x0, x1)), LinearScale((y_ticks[0], y_ticks[-1]), (y1, y0))
    _y_axis(frame, sy, y_ticks)
    _x_axis(frame, sx, x_ticks)
    _axis_label(frame, x_label, y_label)
    for ref in ref_lines:
        if finite(ref.value):
            y = sy(ref.value)
            frame.parts.append(f'<line class="ref" x1="{_n(x0)}" y1="{_n(y)}" x2="{_n(x1)}" y2="{_n(y)}" '
                               f'stroke="{ref.color}" stroke-dasharray="5 3"/>'
                               f'<text x="{_n(x1 - 2)}" y="{_n(y - 3)}" text-anchor="end" fill="{ref.color}">'
                               f'{escape(ref.label)}</text>')
    for s, color in zip(series, colors, strict=True):
        name = escape(s.name)
        for run in _segments(s.band):
            upper = " L".join(f"{_n(sx(x))} {_n(sy(hi))}" for x, lo, hi in run)
            lower = " L".join(f"{_n(sx(x))} {_n(sy(lo))}" for x, lo, hi in reversed(run))
            frame.parts.append(f'<path class="band" data-series="{name}" d="M{upper} L{lower} Z" fill="{color}" '
                               f'fill-opacity="0.18" stroke="none"/>')
        kept = [(x, y) for x, y in s.points if finite(x)]
        gaps = [not finite(y) for _, y in kept]
        pixels = [(sx(x), sy(y) if finite(y) else 0.0) for x, y in kept]
        dash = ' stroke-dasharray="6 3"' if s.dashed else ""
        n_points = len(gaps) - sum(gaps)
        frame.parts.append(f'<path class="line" data-series="{name}" data-points="{n_points}" '
                           f'd="{_paths(pixels, gaps)}" fill="none" stroke="{color}" stroke-width="1.8"{dash}/>')
        if s.markers and n_points <= _MAX_MARKERS:
            for (x, y), (px, py), gap in zip(kept, pixels, gaps, strict=True):
                if not gap:
                    frame.parts.append(
                        f'<circle class="point" data-series="{name}" data-x="{x:.6g}" data-y="{y:.6g}" '
                        f'cx="{_n(px)}" cy="{_n(py)}" r="2.6" fill="{color}"><title>{name}: '
                        f'{escape(format_value(x, 6))}, {escape(format_value(y))}</title></circle>')
    for m in marks:
        if finite(m.x) and finite(m.y):
            px, py = sx(m.x), sy(m.y)
            frame.parts.append(f'<path class="mark {escape(m.kind)}" d="M{_n(px)} {_n(py - 7)} L{_n(px + 6)} '
                               f'{_n(py + 4)} L{_n(px - 6)} {_n(py + 4)} Z" fill="{m.color}" stroke="#fff" '
                               f'stroke-width="1"><title>{escape(m.label)}</title></path>')
    return frame.svg("line-chart")


def interval_chart(title: str, rows: Sequence[IntervalRow], *, x_label: str = "",
                   ref_lines: Sequence[RefLine] = (RefLine(0.0),), width: int = WIDTH,
                   empty_message: str = "no data yet") -> str:
    """One row per estimate: a dot, its interval as a bar, an optional per-row tick (a forest plot)."""
    if not rows:
        return empty_chart(title, empty_message, width)
    # Rows without any value still show, as "not computed" (e.g. a gate check with too few tasks).
    values = [v for r in rows for v in (r.estimate, r.low, r.high, r.tick) if finite(v)]
    values += [r.value for r in ref_lines if finite(r.value)] or [0.0]
    label_w = min(200.0, max(len(r.label) for r in rows) * _CHAR_W + 12)
    row_h = 24
    frame = _Frame(title, width, 0, left=label_w + 8)
    legend = [(label, color, "line") for label, color in dict.fromkeys((r.tick_label, MUTED) for r in rows
                                                                         if r.tick is not None and r.tick_label)]
    _legend(frame, legend)
    frame.height = int(frame.top + row_h * len(rows) + frame.bottom)
    x0, y0, x1, y1 = frame.plot
    ticks = nice_ticks(min(values), max(values))
    sx = LinearScale((ticks[0], ticks[-1]), (x0, x1))
    _x_axis(frame, sx, ticks, grid=True)
    _axis_label(frame, x_label, "")
    for ref in ref_lines:
        if finite(ref.value):
            x = sx(ref.value)
            frame.parts.append(f'<line class="ref" x1="{_n(x)}" y1="{_n(y0 - 2)}" x2="{_n(x)}" y2="{_n(y1)}" '
                               f'stroke="{ref.color}" stroke-dasharray="4 3"/>')
    for i, r in enumerate(rows):
        cy = y0 + row_h * (i + 0.5)
        label = (r.label if len(r.label) * _CHAR_W <= label_w - 12
                 else r.label[: int((label_w - 12) / _CHAR_W) - 1] + "…")
        frame.parts.append(f'<text class="row-label" x="{_n(x0 - 8)}" y="{_n(cy + 4)}" text-anchor="end" '
                           f'fill="#333">{escape(label)}<title>{escape(r.label)}</title></text>')
        if r.tick is not None and finite(r.tick):
            tx = sx(r.tick)
            frame.parts.append(f'<line class="tick-mark" x1="{_n(tx)}" y1="{_n(cy - 8)}" x2="{_n(tx)}" '
                               f'y2="{_n(cy + 8)}" stroke="#555" stroke-width="2"><title>{escape(r.tick_label)} '
                               f'{escape(format_value(r.tick))}</title></line>')
        tooltip = escape(r.tooltip or f"{r.label}: {format_value(r.estimate)} "
                                      f"[{format_value(r.low)}, {format_value(r.high)}]")
        if finite(r.low) and finite(r.high):
            frame.parts.append(f'<line class="interval" x1="{_n(sx(r.low))}" y1="{_n(cy)}" x2="{_n(sx(r.high))}" '
                               f'y2="{_n(cy)}" stroke="{r.color}" stroke-width="3" stroke-linecap="round">'
                               f'<title>{tooltip}</title></line>')
        if finite(r.estimate):
            frame.parts.append(f'<circle class="point estimate" data-series="{escape(r.label)}" '
                               f'data-x="{r.estimate:.6g}" cx="{_n(sx(r.estimate))}" cy="{_n(cy)}" r="4.5" '
                               f'fill="{r.color}" stroke="#fff"><title>{tooltip}</title></circle>')
        else:
            frame.parts.append(f'<text class="no-estimate" x="{_n(x0 + 6)}" y="{_n(cy + 4)}" fill="#888">'
                               f'not computed</text>')
    return frame.svg("interval-chart")


def bar_chart(title: str, bars: Sequence[Bar], *, x_label: str = "", y_label: str = "", width: int = WIDTH,
              height: int = HEIGHT, empty_message: str = "no data yet") -> str:
    """Vertical bars from zero, one per category, labelled underneath."""
    values = [b.value for b in bars if finite(b.value)]
    if not values:
        return empty_chart(title, empty_message, width)
    frame = _Frame(title, width, height)
    x0, y0, x1, y1 = frame.plot
    ticks = nice_ticks(min(0.0, *values), max(0.0, *values))
    sy = LinearScale((ticks[0], ticks[-1]), (y1, y0))
    _y_axis(frame, sy, ticks)
    _axis_label(frame, x_label, y_label)
    slot = (x1 - x0) / len(bars)
    zero = sy(0.0)
    frame.parts.append(f'<line class="axis" x1="{_n(x0)}" y1="{_n(zero)}" x2="{_n(x1)}" y2="{_n(zero)}" '
                       'stroke="#888"/>')
    every = max(1, math.ceil(len(bars) * 40 / (x1 - x0)))  # label every k-th bar when they would overlap
    for i, b in enumerate(bars):
        cx = x0 + slot * (i + 0.5)
        if i % every == 0:
            frame.parts.append(f'<text class="tick" x="{_n(cx)}" y="{_n(y1 + 15)}" text-anchor="middle" '
                               f'fill="#555">{escape(b.label)}</text>')
        if not finite(b.value):
            continue
        top, bottom = sorted((sy(b.value), zero))
        color = b.color or PALETTE[0]
        frame.parts.append(f'<rect class="bar" data-label="{escape(b.label)}" data-value="{b.value:.6g}" '
                           f'x="{_n(cx - slot * 0.35)}" y="{_n(top)}" width="{_n(slot * 0.7)}" '
                           f'height="{_n(max(bottom - top, 0.5))}" fill="{color}"><title>'
                           f'{escape(b.tooltip or f"{b.label}: {format_value(b.value)}")}</title></rect>')
    return frame.svg("bar-chart")


def stacked_chart(title: str, xs: Sequence[float], layers: Sequence[Layer], *, x_label: str = "", y_label: str = "",
                  unit: str = "", width: int = WIDTH, height: int = HEIGHT, empty_message: str = "no data yet") -> str:
    """One bar per x, made of the layers' values stacked bottom up in the order given: a whole and
    its parts (a step's seconds by stage). Negative values are left out, as a part cannot be."""
    def part(layer: Layer, i: int) -> float:
        value = layer.values[i] if i < len(layer.values) else None
        return value if finite(value) and value > 0 else 0.0

    totals = [sum(part(layer, i) for layer in layers) for i in range(len(xs))]
    if not any(totals):
        return empty_chart(title, empty_message, width)
    frame = _Frame(title, width, height)
    colors = [layer.color or PALETTE[i % len(PALETTE)] for i, layer in enumerate(layers)]
    _legend(frame, [(layer.name, c, "line") for layer, c in zip(layers, colors, strict=True)
                    if any(part(layer, i) for i in range(len(xs)))])
    x0, y0, x1, y1 = frame.plot
    ticks = nice_ticks(0.0, max(totals))
    sy = LinearScale((ticks[0], ticks[-1]), (y1, y0))
    _y_axis(frame, sy, ticks)
    _axis_label(frame, x_label, y_label)
    slot = (x1 - x0) / len(xs)
    every = max(1, math.ceil(len(xs) * 40 / (x1 - x0)))  # label every k-th bar when they would overlap
    for i, x in enumerate(xs):
        cx = x0 + slot * (i + 0.5)
        if i % every == 0:
            frame.parts.append(f'<text class="tick" x="{_n(cx)}" y="{_n(y1 + 15)}" text-anchor="middle" '
                               f'fill="#555">{escape(format_value(x, 6))}</text>')
        base = 0.0
        for layer, color in zip(layers, colors, strict=True):
            value = part(layer, i)
            if not value:
                continue
            top, bottom = sy(base + value), sy(base)
            base += value
            frame.parts.append(
                f'<rect class="stacked" data-series="{escape(layer.name)}" data-x="{x:.6g}" '
                f'data-value="{value:.6g}" x="{_n(cx - slot * 0.4)}" y="{_n(top)}" width="{_n(slot * 0.8)}" '
                f'height="{_n(max(bottom - top, 0.5))}" fill="{color}"><title>{escape(layer.name)} at '
                f'{escape(format_value(x, 6))}: {escape(format_value(value))}{escape(unit)} of '
                f'{escape(format_value(totals[i]))}{escape(unit)}</title></rect>')
    return frame.svg("stacked-chart")
