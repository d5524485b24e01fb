"""A stacked area chart in block cells, for a GPU's own screen (issue 33.2).  Pure: timelines
in, Rich `Text` lines out, no Textual.

Each process's reserved bytes is sampled at its own rounds' times, so the series do not share
times and cannot be summed sample by sample.  Each is resampled onto the chart's own column
grid instead: at each column's time, the value in force (the newest sample at or before it),
held for at most HOLD_INTERVALS of its own sampling interval; a process absent then (before it
arrived, in a gap of its samples, after it left) contributes nothing there, never a value
interpolated across its absence.  The bands are stacked in the order given, clipped at the
GPU's used bytes, and the rest of used (outside PyTorch, other processes, unattributed) is a
band of its own up to used.

A terminal cell holds one glyph with a foreground and a background colour: a lower-eighth
block (▁…▇) paints two bands, so a cell shows the boundary between two bands at 1/8 of a row.
Where three bands meet in one cell, the two that own most of it are drawn.

Events (OOMs, memtop's actions, agents arriving and leaving) are marked on a row of their own
under the plot, in the column whose time span holds them, with as many labels as fit without
overlapping, the most important first.
"""

from __future__ import annotations

import itertools
import time as _time
from bisect import bisect_left, bisect_right
from collections.abc import Sequence

from rich.style import Style
from rich.text import Text

from memtop.base.records import record
from memtop.figures.median import median

HOLD_INTERVALS = 3.0  # a sample stays in force this many of its series' intervals after it
HOLD_MIN_S = 1.0
_INTERVALS_READ = 64  # the sampling interval is the median of the newest ones (bounded cost)
_LOWER = " ▁▂▃▄▅▆▇█"  # a lower block of n eighths


@record(frozen=True, slots=True)
class Timeline:
    """One series as sampled, in unix time, oldest first: a process's reserved bytes on a GPU,
    or the GPU's used bytes.  `ended`: the process left after its last sample (it contributes
    nothing after it); otherwise its newest value is held like any other."""

    name: str
    times: Sequence[float]
    values: Sequence[float]
    ended: bool = False

    def hold_s(self) -> float:
        """How long a sample stays in force: a few of the series' own sampling intervals."""
        times = self.times[-_INTERVALS_READ - 1 :]
        steps = [b - a for a, b in itertools.pairwise(times) if b > a]
        return max(HOLD_MIN_S, HOLD_INTERVALS * median(steps)) if steps else HOLD_MIN_S

    def resample(self, grid: Sequence[float]) -> list[float | None]:
        """The value in force at each time of `grid` (ascending); None where the series was
        absent: before its first sample, in a gap of more than its hold between two samples,
        after it ended.  A series that has not ended holds its newest value to the end (a
        round that is late is not a process gone: the dashboard shows the same value)."""
        times, values = self.times, self.values
        if not times:
            return [None] * len(grid)
        hold, last = self.hold_s(), len(times) - 1
        out: list[float | None] = []
        for t in grid:
            i = bisect_right(times, t) - 1
            gone = i == last and self.ended and t > times[i]
            if i < 0 or gone or (i < last and t - times[i] > hold):
                out.append(None)
            else:
                out.append(values[i])
        return out


@record(frozen=True, slots=True)
class Band:
    """One band of the stack: one process, or several summed ("3 more pids")."""

    name: str
    colour: str
    parts: tuple[Timeline, ...]


@record(frozen=True, slots=True)
class Stack:
    """The chart's data on its column grid: what the cells draw, and what tests check."""

    grid: tuple[float, ...]  # each column's time (the right edge of its span), unix
    used: tuple[float | None, ...]  # the GPU's used bytes in force (None: not read then)
    heights: tuple[tuple[float, ...], ...]  # per band, per column: its height, stack ≤ used

    def top(self, column: int) -> float:
        return sum(band[column] for band in self.heights)


def grid(start: float, end: float, cols: int) -> tuple[float, ...]:
    """The columns' times: column c spans (grid[c-1], grid[c]], the last ends at `end`."""
    span = (end - start) or 1.0
    return tuple(start + span * (c + 1) / cols for c in range(cols))


def column_of(at: float, columns: Sequence[float], start: float) -> int | None:
    """The column whose span holds the time `at`; None outside the chart's window."""
    if not columns or at < start or at > columns[-1]:
        return None
    return min(bisect_left(columns, at), len(columns) - 1)


def stack(used: Timeline | None, bands: Sequence[Band], columns: Sequence[float]) -> Stack:
    used_at = used.resample(columns) if used is not None else [None] * len(columns)
    sums = []
    for band in bands:
        total = [0.0] * len(columns)
        for part in band.parts:
            for c, value in enumerate(part.resample(columns)):
                if value is not None:
                    total[c] += value
        sums.append(total)
    # Clipped at used: the rounds of the driver and of the agents are not simultaneous, and a
    # stack above the bytes the driver counts would be a picture of nothing.
    heights = [[0.0] * len(columns) for _ in bands]
    for c in range(len(columns)):
        room = used_at[c]
        below = 0.0
        for b, total in enumerate(sums):
            height = total[c] if room is None else max(0.0, min(total[c], room - below))
            heights[b][c] = height
            below += height
    return Stack(tuple(columns), tuple(used_at), tuple(tuple(h) for h in heights))


def cells(
    data: Stack, colours: Sequence[str], rest_colour: str, rows: int, high: float
) -> list[Text]:
    """The plot, top row first: each band in its colour, the rest of used above the stack in
    `rest_colour`, nothing above used."""
    units = rows * 8
    scale = units / (high or 1.0)
    columns: list[list[tuple[int, str]]] = []  # per column: (top level in eighths, colour)
    for c in range(len(data.grid)):
        segments = []
        below = 0.0
        for b, band in enumerate(data.heights):
            below += band[c]
            segments.append((min(units, round(below * scale)), colours[b]))
        used = data.used[c]
        if used is not None and used > below:
            segments.append((min(units, round(used * scale)), rest_colour))
        columns.append(segments)
    column_tops = [[top for top, _ in segments] for segments in columns]
    out = []
    styles: dict[tuple[str | None, str | None], Style] = {}
    for row in range(rows - 1, -1, -1):
        floor = row * 8
        runs: list[tuple[str, Style]] = []  # (glyphs, style): a run of cells in one style
        for segments, tops in zip(columns, column_tops, strict=True):
            # Most cells lie inside one segment, or above them all: only the rest are judged.
            inside = bisect_right(tops, floor)
            key: tuple[str | None, str | None]
            if inside == len(tops):
                glyph, key = " ", (None, None)
            elif tops[inside] >= floor + 8:
                glyph, key = " ", (None, segments[inside][1])
            else:
                glyph, key = _cell(segments, floor)
            style = styles.get(key)
            if style is None:
                style = styles[key] = Style(color=key[0], bgcolor=key[1])
            if runs and runs[-1][1] is style:
                runs[-1] = (runs[-1][0] + glyph, style)
            else:
                runs.append((glyph, style))
        out.append(Text.assemble(*runs))
    return out


def _cell(
    segments: Sequence[tuple[int, str]], floor: int
) -> tuple[str, tuple[str | None, str | None]]:
    """One cell spanning eighths [floor, floor + 8) where segments meet: the split (at a
    boundary between them) and the two colours that paint most of it right, as (glyph,
    (foreground, background))."""
    runs: list[tuple[str | None, int]] = []  # (owner, eighths), bottom first
    bottom = 0
    for top, colour in segments:
        lo, hi = max(bottom, floor), min(top, floor + 8)
        if hi > lo:
            runs.append((colour, hi - lo))
        bottom = max(bottom, top)
    filled = sum(n for _, n in runs)
    if filled < 8:
        runs.append((None, 8 - filled))
    best: tuple[int, int, str | None, str | None] = (-1, 0, None, None)
    split = 0
    for i in range(1, len(runs)):
        split += runs[i - 1][1]
        lower, lower_n = _majority(runs[:i])
        upper, upper_n = _majority(runs[i:])
        if lower_n + upper_n > best[0]:
            best = (lower_n + upper_n, split, lower, upper)
    _, split, lower, upper = best
    if lower is None or lower == upper or not 0 < split < 8:
        # One colour: its background (a full block's glyph leaves seams between cells in
        # some terminals and in the SVG screenshots).
        return " ", (None, upper if lower is None or lower == upper else lower)
    return _LOWER[split], (lower, upper)


def _majority(runs: Sequence[tuple[str | None, int]]) -> tuple[str | None, int]:
    """The owner of most eighths among `runs`, and how many it owns."""
    if len(runs) == 1:
        return runs[0]
    counts: dict[str | None, int] = {}
    for owner, n in runs:
        counts[owner] = counts.get(owner, 0) + n
    owner = max(counts, key=counts.__getitem__)
    return owner, counts[owner]


# ------------------------------------------------------------------ events

# What each kind of event is marked with, and its weight when labels compete for room.
MARKS = {
    "oom": ("▼", "#e63c50", "OOM"),
    "left": ("△", "#a0a0a0", "left"),
    "arrived": ("▲", "#5fa02a", "arrived"),
}
ACTION_MARK = ("◆", "#50c8e6")  # memtop's own actions: cleanup, tune, reset_peak, …
_RANK = {"oom": 0, "left": 2, "arrived": 3}  # actions rank 1
LABEL_TRIES = 24  # the events tried for a label (a row holds a few; an OOM storm has hundreds)


@record(frozen=True, slots=True)
class ChartEvent:
    """Something that happened on a GPU, to mark on its chart's time axis."""

    time: float  # unix
    kind: str  # "oom", "arrived", "left", or the command of an action memtop performed
    pid: int

    @property
    def glyph(self) -> tuple[str, str]:
        mark = MARKS.get(self.kind)
        return (mark[0], mark[1]) if mark else ACTION_MARK

    @property
    def what(self) -> str:
        mark = MARKS.get(self.kind)
        return mark[2] if mark else self.kind.replace("_", " ")

    def label(self, short: bool = False) -> str:
        """ "▼ OOM 02:14:07 pid 4242" (short: "▼ OOM 02:14:07")."""
        clock = _time.strftime("%H:%M:%S", _time.localtime(self.time))
        glyph = self.glyph[0]
        return f"{glyph} {self.what} {clock}" + ("" if short else f" pid {self.pid}")


def marker_row(
    events: Sequence[ChartEvent], columns: Sequence[float], start: float
) -> tuple[Text, dict[ChartEvent, int]]:
    """The row under the plot: each event's glyph in its column (an OOM over an action over an
    agent's coming and going where they share one), then labels, the most important and newest
    first, each where it overlaps no glyph and no other label.  Also where each event landed."""
    cols = len(columns)
    landed: dict[ChartEvent, int] = {}
    for event in events:
        column = column_of(event.time, columns, start)
        if column is not None:
            landed[event] = column
    order = sorted(landed, key=lambda e: (_RANK.get(e.kind, 1), -e.time))
    chars: list[tuple[str, str]] = [(" ", "")] * cols
    taken = [False] * cols
    for event in reversed(order):  # the most important last, so it wins its column
        chars[landed[event]] = event.glyph
        taken[landed[event]] = True
    for event in order[:LABEL_TRIES]:
        column = landed[event]
        if chars[column] != event.glyph:
            continue  # its column shows a more important event
        for text in (event.label(), event.label(short=True)):
            if _place(text[2:], column, chars, taken, event.glyph[1]):
                break
    runs: list[tuple[str, str]] = []
    for ch, colour in chars:
        if runs and runs[-1][1] == colour:
            runs[-1] = (runs[-1][0] + ch, colour)
        else:
            runs.append((ch, colour))
    return Text.assemble(*runs), landed


def _place(
    words: str, column: int, chars: list[tuple[str, str]], taken: list[bool], colour: str
) -> bool:
    """`words` right of the glyph in `column` (a space between), else left of it, where they
    and a free column on their far side overlap nothing: two labels never run together."""
    cols, n = len(chars), len(words)
    right = (column + 2, column + 1, column + 2 + n)  # (first letter, span taken)
    left = (column - 1 - n, column - 1 - n, column)
    for lo, first, end in (right, left):
        if lo < 0 or lo + n > cols:
            continue
        if any(taken[max(0, first - (lo != right[0])) : min(cols, end + (lo == right[0]))]):
            continue
        for i, ch in enumerate(words):
            chars[lo + i] = (ch, colour)
        for i in range(first, end):
            taken[i] = True
        return True
    return False
