"""A line chart in braille cells (2 × 4 dots each), for the detail screen's history (issue 33.1).

Pure: series in, Rich `Text` lines out, no Textual.  What it does that a plotting library's
terminal backend did not:

- a band series (allocated) is drawn as its min–max in each pixel column, so a sawtooth
  sampled at 1 Hz reads as the band it is, not as scattered points;
- series are drawn in the order given and a cell takes the colour of the last series that set
  a dot in it: the caller lists the lines that matter (baseline, trend) last, and they stay
  visible over the areas;
- the y-range is the caller's (fitted to the regime being judged, not to a warm-up at 0);
- a label can be pinned at the right edge beside a series' last point (the trend's time to
  full).

`Chart.pixels(name)` gives the dots one series set, for tests that judge the drawing itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from rich.text import Text

from memtop.base.records import record

# Dot bits of a braille cell by (row, column) of its 4 × 2 dots.
_DOTS = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))


@record(frozen=True)
class Line:
    name: str
    xs: Sequence[float]
    ys: Sequence[float]  # the highs of a band
    colour: str
    lows: Sequence[float] | None = None  # a band: min of each sample's bin
    points: bool = False  # dots at the samples, not joined (a baseline per step)


@dataclass
class Chart:
    cols: int
    rows: int
    x_range: tuple[float, float]
    y_range: tuple[float, float]
    _bits: list[list[int]] = field(init=False)
    _owner: list[list[str | None]] = field(init=False)
    _pixels: dict[str, set[tuple[int, int]]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._bits = [[0] * self.cols for _ in range(self.rows)]
        self._owner = [[None] * self.cols for _ in range(self.rows)]
        self._colour: dict[str, str] = {}

    @property
    def width(self) -> int:  # in dots
        return self.cols * 2

    @property
    def height(self) -> int:
        return self.rows * 4

    def px(self, x: float) -> int:
        lo, hi = self.x_range
        return round((x - lo) / ((hi - lo) or 1.0) * (self.width - 1))

    def py(self, y: float) -> int:
        """Dot row of `y`, 0 at the top; clipped to the canvas."""
        lo, hi = self.y_range
        row = round((hi - y) / ((hi - lo) or 1.0) * (self.height - 1))
        return max(0, min(self.height - 1, row))

    def _set(self, name: str, x: int, y: int) -> None:
        if not (0 <= x < self.width and 0 <= y < self.height):
            return
        row, col = y // 4, x // 2
        self._bits[row][col] |= _DOTS[y % 4][x % 2]
        self._owner[row][col] = name
        self._pixels.setdefault(name, set()).add((x, y))

    def _segment(self, name: str, x0: int, y0: int, x1: int, y1: int) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(steps + 1):
            self._set(name, round(x0 + (x1 - x0) * i / steps), round(y0 + (y1 - y0) * i / steps))

    def draw(self, line: Line) -> None:
        self._colour[line.name] = line.colour
        points = [(x, y) for x, y in zip(line.xs, line.ys, strict=False) if y == y]
        if line.lows is not None:
            # One span per dot column: the min and max of every sample that falls in it.
            spans: dict[int, tuple[int, int]] = {}
            for x, hi, lo in zip(line.xs, line.ys, line.lows, strict=False):
                if hi != hi or lo != lo:
                    continue
                col = self.px(x)
                top, bottom = self.py(hi), self.py(lo)
                old = spans.get(col)
                spans[col] = (min(top, old[0]), max(bottom, old[1])) if old else (top, bottom)
            previous: tuple[int, int, int] | None = None
            for col in sorted(spans):
                top, bottom = spans[col]
                for dot_row in range(top, bottom + 1):
                    self._set(line.name, col, dot_row)
                if previous is not None and col - previous[0] > 1:  # a gap: join the tops
                    self._segment(line.name, previous[0], previous[1], col, top)
                previous = (col, top, bottom)
            return
        if line.points:
            for at, value in points:
                self._set(line.name, self.px(at), self.py(value))
            return
        for (xa, ya), (xb, yb) in itertools.pairwise(points):
            self._segment(line.name, self.px(xa), self.py(ya), self.px(xb), self.py(yb))
        if len(points) == 1:
            self._set(line.name, self.px(points[0][0]), self.py(points[0][1]))

    def pixels(self, name: str) -> set[tuple[int, int]]:
        return set(self._pixels.get(name, ()))

    def visible(self, name: str) -> set[tuple[int, int]]:
        """The dots of `name` in cells it owns (the colour a reader sees)."""
        return {
            (x, y) for x, y in self._pixels.get(name, ()) if self._owner[y // 4][x // 2] == name
        }

    def lines(self) -> list[Text]:
        out = []
        for bits, owners in zip(self._bits, self._owner, strict=True):
            text = Text()
            for bit, owner in zip(bits, owners, strict=True):
                if bit:
                    text.append(chr(0x2800 + bit), style=self._colour.get(owner or "", ""))
                else:
                    text.append(" ")
            out.append(text)
        return out


def render(
    lines: Sequence[Line],
    cols: int,
    rows: int,
    x_range: tuple[float, float],
    y_range: tuple[float, float],
) -> Chart:
    chart = Chart(max(1, cols), max(1, rows), x_range, y_range)
    for line in lines:
        chart.draw(line)
    return chart
