"""A GPU's own chart (issue 33.2): its processes' reserved bytes stacked under its used bytes
over the window held, the rest of used above them, and what happened on it marked on a row
under the time axis (memtop.ui.stacked draws; memtop.ui.view says what).

`gpu_chart(detail, width, height)` is the whole drawing (pure, for tests and screenshots); the
widget asks it again only when its size or its detail changes (once a round at most, on this
screen only: its cost is the columns × the bands' samples found by bisection).
"""

from __future__ import annotations

import time

from rich.console import Group, RenderableType
from rich.text import Text
from textual.widget import Widget

from memtop.base.records import record
from memtop.figures.units import GiB
from memtop.ui import stacked
from memtop.ui.view import GpuDetail

REST_COLOUR = "#6e4a78"  # the rest of used: outside PyTorch, other processes, unattributed
REST_NAME = "rest of used"
Y_LABEL_W = 7  # "12.3G" and a rule
AXIS_ROWS = 1
MARKER_MIN_ROWS = 4  # below this many rows, no marker row (the plot needs them)


@record(frozen=True, slots=True)
class Drawn:
    lines: list[Text]
    stack: stacked.Stack | None = None
    landed: dict[stacked.ChartEvent, int] | None = None  # the column each event landed in
    plot_rows: int = 0


def gpu_chart(detail: GpuDetail | None, width: int, height: int) -> Drawn:
    if detail is None or detail.start is None or detail.newest is None:
        return Drawn([Text("no history yet", style="dim")])
    if width < Y_LABEL_W + 8 or height < 2:
        return Drawn([Text("no room for the chart", style="dim")])
    markers = height >= MARKER_MIN_ROWS
    rows = height - AXIS_ROWS - markers
    cols = width - Y_LABEL_W
    start, newest = detail.start, detail.newest
    columns = stacked.grid(start, newest, cols)
    data = stacked.stack(detail.used_timeline, detail.bands, columns)
    high = max([u for u in data.used if u is not None] + [data.top(c) for c in range(cols)])
    high = (high or 1.0) * 1.05
    plot = stacked.cells(data, [b.colour for b in detail.bands], REST_COLOUR, rows, high)
    middle = (rows - 1) // 2  # labelled by its top edge, as the top row is
    labels = {0: high, rows - 1: 0.0, middle: high * (rows - middle) / rows}
    out = []
    for i, line in enumerate(plot):
        label = f"{labels[i] / GiB:5.1f}G" if i in labels and rows > 1 else ""
        # The label dim, not the row: a Text's own style is every span's base, and a dim
        # base fades the bands' colours too.
        row = Text()
        row.append(f"{label:>{Y_LABEL_W - 1}}│", style="dim")
        row.append_text(line)
        out.append(row)
    landed: dict[stacked.ChartEvent, int] = {}
    if markers:
        marks, landed = stacked.marker_row(detail.events, columns, start)
        row = Text()
        row.append(" " * (Y_LABEL_W - 1) + "│", style="dim")
        row.append_text(marks)
        out.append(row)
    out.append(_x_axis(start, newest, cols))
    return Drawn(out, data, landed, rows)


def _x_axis(start: float, newest: float, cols: int) -> Text:
    """Wall-clock ticks under the plot, each at the column whose span holds its time."""
    axis = [" "] * cols
    span = newest - start
    if span > 0:
        fmt = "%H:%M:%S" if span < 600 else "%H:%M"
        ticks = 4 if cols >= 48 else 2
        for i in range(ticks + 1):
            at_time = start + span * i / ticks
            label = time.strftime(fmt, time.localtime(at_time))
            column = round(i / ticks * (cols - 1))
            at = column - (len(label) - 1 if i == ticks else len(label) // 2)
            at = max(0, min(cols - len(label), at))
            axis[at : at + len(label)] = list(label)
    return Text(" " * Y_LABEL_W + "".join(axis), style="dim")


def legend(detail: GpuDetail) -> Text:
    """The bands, in their colours, bottom of the stack first; then the rest of used."""
    title = Text("Memory  ")
    for band in detail.bands:
        title.append("■ ", style=band.colour)
        title.append(f"{band.name}  ")
    if detail.used_timeline is not None:
        title.append("■ ", style=REST_COLOUR)
        title.append(REST_NAME if detail.bands else "used (no agent on it)")
    return title


def event_legend(detail: GpuDetail) -> Text:
    """The kinds of events in the window, in their glyphs, with how many where more than one
    (the border under the chart: an OOM storm hides an action's glyph in its column, not its
    count here)."""
    seen: dict[str, tuple[tuple[str, str], int]] = {}
    for event in detail.events:
        if detail.start is not None and event.time >= detail.start:
            mark, count = seen.get(event.what, (event.glyph, 0))
            seen[event.what] = (mark, count + 1)
    text = Text()
    for what, ((glyph, colour), count) in seen.items():
        text.append(f" {glyph}", style=colour)
        text.append(f" {what}" + (f" ×{count}" if count > 1 else "") + " ")
    return text


class GpuChart(Widget):
    """Draws `gpu_chart` at its own size; `show(detail)` when the round changes."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.detail: GpuDetail | None = None
        self._drawn: tuple[tuple[int, int], GpuDetail | None] = ((0, 0), None)
        self._lines: list[Text] = []

    def show(self, detail: GpuDetail) -> None:
        if detail is self.detail:
            return
        self.detail = detail
        self.border_title = legend(detail)
        self.border_subtitle = event_legend(detail)
        self.refresh()

    def render(self) -> RenderableType:
        size = (self.content_size.width, self.content_size.height)
        if self.detail is None:
            return Text("no history yet", style="dim")
        if self._drawn[0] != size or self._drawn[1] is not self.detail:
            self._lines = gpu_chart(self.detail, *size).lines
            self._drawn = (size, self.detail)
        return Group(*self._lines)
