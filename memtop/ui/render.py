"""Rich Text builders for the dashboard's one-line graphics: memory bars, sparklines, gauges.

Pure functions of numbers and a width, so their look is tested without a terminal.  Colours are
few and fixed (every colour change costs escape bytes on the wire).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from rich.text import Span, Text

from memtop.figures.units import short_bytes

__all__ = ["short_bytes"]  # re-exported: widgets take it from here with the other builders

ALLOCATED = "green"
CACHED = "yellow"
OTHER = "magenta"
FREE = "bright_black"
PEAK = "bold bright_white"
SPARK = " ▁▂▃▄▅▆▇█"

SEVERITY_STYLES = {
    "emergency": "bold white on red",
    "critical": "bold red",
    "warning": "bold yellow",
    "info": "cyan",
}


# How far past a cell's middle a figure must go before a bar drawn before moves its edge: a
# sawtooth's allocated bytes wavering across the middle of a cell flipped that cell's colour
# every second (9-14 bytes a second to the terminal for one leaking GPU's card, and a flicker
# the eye follows); held, the edge is never more than 0.5 + this of a cell from the figure.
BAR_HOLD_CELLS = 0.3


@dataclass
class BarEdges:
    """Where one bar's edges were drawn last (in cells), kept by the widget that draws it."""

    width: int = 0
    total: int = 0
    allocated: int = -1
    reserved: int = -1
    other: int = -1


def memory_bar(
    width: int,
    total: int | None,
    allocated: int,
    reserved: int,
    other: int | None,
    peak: int | None,
    used: int | None = None,
    edges: BarEdges | None = None,
) -> Text:
    """`width` cells: allocated, then the cache PyTorch holds unallocated, then memory outside
    PyTorch's caches, then free; the peak of allocated as a bright mark.  Without agents, the
    driver's used memory fills the bar as `other`.  With `edges` (what this bar showed last,
    updated here), an edge moves only when its figure is `BAR_HOLD_CELLS` past the middle of
    the cell it would leave."""
    if width <= 0:
        return Text()
    if not total:
        return Text("·" * width, style=FREE)
    a, c, o, f, mark = bar_cells(width, total, allocated, reserved, other, peak, used, edges)
    # Runs of one style, one span each (far fewer escape sequences than one per cell); the
    # four styles differ, so no two runs merge.  The peak's mark is a cell of its own style,
    # cut out of the run it falls in.
    runs = [(n, glyph, style) for n, glyph, style in _bar_runs(a, c, o, f) if n]
    if mark is not None:
        at = 0
        for index, (n, glyph, style) in enumerate(runs):
            if at <= mark < at + n:
                cut = [(mark - at, glyph, style), (1, "┃", PEAK), (at + n - mark - 1, glyph, style)]
                runs[index : index + 1] = [run for run in cut if run[0]]
                break
            at += n
    # The Text made at once from its characters and spans, as appending each run made it
    # (Text.append cleans each run of control codes: the bar has none, and a run of █ cost a
    # dict look-up a character).
    spans = []
    start = 0
    for n, _, style in runs:
        spans.append(Span(start, start + n, style))
        start += n
    return Text("".join(glyph * n for n, glyph, _ in runs), spans=spans)


def bar_cells(
    width: int,
    total: int,
    allocated: int,
    reserved: int,
    other: int | None,
    peak: int | None,
    used: int | None = None,
    edges: BarEdges | None = None,
) -> tuple[int, int, int, int, int | None]:
    """A bar's cells (width > 0, total > 0): how many are allocated, cached, other and free,
    and the peak's cell (None without a peak), with `edges` held and updated as memory_bar
    says."""
    if other is None and not reserved:
        other = used or 0
    held = edges is not None and edges.width == width and edges.total == total

    def cells(n: int | float, last: int = -1) -> int:
        exact = width * n / total
        if held and last >= 0 and abs(exact - last) < 0.5 + BAR_HOLD_CELLS:
            return last
        return max(0, min(width, round(exact)))

    a_end = cells(allocated, edges.allocated if edges else -1)
    r_end = cells(reserved, edges.reserved if edges else -1)
    o_cells = cells(other or 0, edges.other if edges else -1)
    if edges is not None:
        edges.width, edges.total = width, total
        edges.allocated, edges.reserved, edges.other = a_end, r_end, o_cells
    a = a_end
    c = max(0, r_end - a)
    o = max(0, min(width - a - c, o_cells))
    mark = min(width - 1, max(0, cells(peak) - 1)) if peak else None
    return a, c, o, width - a - c - o, mark


def _bar_runs(a: int, c: int, o: int, f: int) -> tuple[tuple[int, str, str], ...]:
    """A bar's runs of cells, left to right: allocated, cached, other, free."""
    return ((a, "█", ALLOCATED), (c, "█", CACHED), (o, "█", OTHER), (f, "·", FREE))


SLOW_S = 4.0  # how often figures that move without news are shown anew


def slow_tick(period: float = SLOW_S) -> int:
    """The number of the current slow period.  Every widget takes its slow figures anew when
    this changes, so they all change in one frame every `period` rather than in a different
    frame each (each frame with a change costs a compositor pass and bytes on the wire)."""
    return int(time.monotonic() // period)


def bin_reduce(values: Sequence[float], points: int, reduce=min) -> list[float]:  # type: ignore[no-untyped-def]
    """At most `points` values, each the reduction of one equal bin (oldest first)."""
    if len(values) <= points:
        return list(values)
    out = []
    for i in range(points):
        start = i * len(values) // points
        end = (i + 1) * len(values) // points
        out.append(reduce(values[start:end]))
    return out


def sparkline(values: Sequence[float], width: int, floor: float, span: float) -> str:
    """One row of block glyphs, the newest value at the right; fewer values than cells are
    right-aligned (the left stays blank until history fills it)."""
    if width <= 0:
        return ""
    if not values:
        return " " * width
    points = bin_reduce(values, width, min)
    span = span if span > 0 else 1.0
    top = len(SPARK) - 1
    glyphs = [SPARK[max(1, min(top, 1 + round((v - floor) / span * (top - 1))))] for v in points]
    return " " * (width - len(glyphs)) + "".join(glyphs)


def fragmentation_style(gauge: float | None) -> str:
    if gauge is None:
        return FREE
    if gauge >= 0.2:
        return "bold red"
    if gauge >= 0.1:
        return "yellow"
    return "green"


def usage_style(share: float | None) -> str:
    if share is None:
        return ""
    if share >= 0.95:
        return "bold white on red"
    if share >= 0.90:
        return "bold red"
    if share >= 0.85:
        return "yellow"
    return ""


def gauge(value: float, width: int) -> str:
    """A small horizontal gauge of a 0..1 value in eighths of a cell."""
    eighths = round(max(0.0, min(1.0, value)) * width * 8)
    full, part = divmod(eighths, 8)
    partial = " ▏▎▍▌▋▊▉"[part] if part else ""
    return ("█" * full + partial).ljust(width)
