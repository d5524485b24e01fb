"""The detail screen's history chart (issue 33.1): braille lines, a band for allocated, the
per-step baseline and the leak's fitted slope on top, the y-range fitted to the regime being
judged, wall-clock ticks, and the time to full at the right edge of the slope.

`chart_lines(detail, width, height)` is the whole drawing (pure, for tests and screenshots);
the widget only asks it again when its size or its detail changes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from rich.console import Group, RenderableType
from rich.text import Text
from textual.widget import Widget

from memtop.diagnosis import DeviceDiagnosis
from memtop.figures.units import GiB, format_duration
from memtop.ui import braille
from memtop.ui.view import Series

# RGB hex, not colour names: a terminal's palette turned "yellow" purple in some themes.
COLOURS = {
    "reserved": "#e6be00",
    "peak": "#e63c50",
    "allocated": "#5fa02a",
    "baseline": "#50c8e6",
    "leak trend": "#f0f0f0",
    "GPU used": "#c85ad2",
    "host RSS": "#c85ad2",
}
OTHER = "#f0f0f0"
# Drawn in this order: the lines a reader judges (baseline, trend) last, so they stay on top.
ORDER = ("GPU used", "host RSS", "reserved", "peak", "allocated", "leak trend", "baseline")
Y_LABEL_W = 7  # "12.3G " and a rule
X_LABEL_ROWS = 1


class Charted(Protocol):
    """What the chart reads: a process's Detail (memtop.ui.view)."""

    @property
    def series(self) -> tuple[Series, ...]: ...
    @property
    def trend_line(self) -> Series | None: ...
    @property
    def device(self) -> DeviceDiagnosis | None: ...
    @property
    def newest(self) -> float | None: ...


def colour_of(name: str, series: Sequence[Series] = ()) -> str:
    return COLOURS.get(name, OTHER)


def drawn_series(detail: Charted, rows: int) -> list[Series]:
    """What the chart draws at `rows` plot rows, in drawing order: fewer series when short
    (the flat peak first, then reserved), never the baseline or the trend."""
    lines = [*detail.series, *([detail.trend_line] if detail.trend_line else [])]
    dropped = set()
    if rows < 8:
        dropped.add("peak")
    if rows < 5:
        dropped.add("reserved")
    kept = [s for s in lines if s.xs and s.name not in dropped]
    return sorted(kept, key=lambda s: ORDER.index(s.name) if s.name in ORDER else len(ORDER))


def y_range(detail: Charted, series: Sequence[Series]) -> tuple[float, float, bool]:
    """(low, high, cut): the range of what is drawn, from 0 unless a leak's regime is being
    judged; then from just under the regime's lowest value, so the slope is not flattened by
    a warm-up at zero (`cut` says so)."""
    high = max((max(s.ys) for s in series if s.ys), default=1.0) or 1.0
    trend = detail.trend_line
    if trend is None or not trend.xs:
        return 0.0, high * 1.05, False
    start = trend.xs[0]
    lows = [
        y
        for s in series
        for x, y in zip(s.xs, s.lows if s.lows is not None else s.ys, strict=False)
        if x >= start and s.name in ("allocated", "baseline", "leak trend")
    ]
    low = min(lows, default=0.0)
    if low <= 0.15 * high:
        return 0.0, high * 1.05, False
    span = high - low
    return max(0.0, low - 0.08 * span), high + 0.05 * span, True


def chart_lines(detail: Charted | None, width: int, height: int) -> list[Text]:
    if detail is None or width < Y_LABEL_W + 8 or height < 2:
        return [Text("no history yet", style="dim")]
    rows = height - X_LABEL_ROWS
    series = drawn_series(detail, rows)
    if not series:
        return [Text("no history yet", style="dim")]
    trend = detail.trend_line
    full = _time_to_full(detail)
    right = len(full) + 1 if trend is not None and full else 1
    cols = max(4, width - Y_LABEL_W - right)
    oldest = min(min(s.xs) for s in series)
    low, high, _ = y_range(detail, series)
    chart = braille.render(
        [
            braille.Line(
                s.name,
                s.xs,
                s.ys,
                colour_of(s.name, series),
                lows=s.lows,
                points=s.name == "baseline",
            )
            for s in series
        ],
        cols,
        rows,
        (oldest, 0.0),
        (low, high),
    )
    plot = chart.lines()
    labels = {0: high, rows - 1: low, (rows - 1) // 2: (high + low) / 2}
    out = []
    end_row = chart.py(trend.ys[-1]) // 4 if trend is not None and trend.ys else None
    for i, line in enumerate(plot):
        label = f"{labels[i] / GiB:5.1f}G" if i in labels else ""
        # The label dim, not the row: a Text's own style is the base of all its spans, and
        # a dim base fades every series' colour.
        row = Text()
        row.append(f"{label:>{Y_LABEL_W - 1}}│", style="dim")
        row.append_text(line)
        if end_row == i and full:
            row.append(" " + full, style=COLOURS["leak trend"])
        out.append(row)
    out.append(_x_axis(detail, oldest, cols))
    return out


def _time_to_full(detail: Charted) -> str:
    device = detail.device
    seconds = device.leak.seconds_to_full if device is not None else None
    return f"full {format_duration(seconds)}" if seconds else ""


def _x_axis(detail: Charted, oldest: float, cols: int) -> Text:
    """Wall-clock ticks under the plot: '14:03' reads better than '-1800 s'."""
    axis = [" "] * cols
    newest = detail.newest
    span = -oldest
    if newest is not None and span > 0:
        fmt = "%H:%M:%S" if span < 600 else "%H:%M"
        ticks = 4 if cols >= 48 else 2
        for i in range(ticks + 1):
            t = oldest + span * i / ticks
            label = time.strftime(fmt, time.localtime(newest + t))
            at = round(i / ticks * (cols - 1)) - (len(label) if i == ticks else len(label) // 2)
            at = max(0, min(cols - len(label), at))
            axis[at : at + len(label)] = list(label)
    return Text(" " * Y_LABEL_W + "".join(axis), style="dim")


class HistoryChart(Widget):
    """Draws `chart_lines` at its own size; `show(detail)` when the round changes."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.detail: Charted | None = None
        self._legend = ""

    def show(self, detail: Charted) -> None:
        self.detail = detail
        self.refresh()

    def render(self) -> RenderableType:
        size = self.content_size
        if self.detail is not None:
            # The legend is the title, and names what is drawn at this height (the screen's
            # own size can be unknown when the detail arrives: only the chart knows its rows).
            title = legend(self.detail, size.height - X_LABEL_ROWS)
            if self._legend != title.plain:
                self._legend = title.plain
                self.border_title = title
        return Group(*chart_lines(self.detail, size.width, size.height))


def legend(detail: Charted, rows: int) -> Text:
    series = drawn_series(detail, rows)
    title = Text("History  ")
    for s in series:
        title.append("■ ", style=colour_of(s.name, series))
        title.append(f"{s.name}  ")
    if series and y_range(detail, series)[2]:
        title.append("(y: warm-up cut)", style="dim")
    return title
