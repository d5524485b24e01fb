"""The detail screen's history chart (issue 33.1), judged on its dots: a known leak drawn at
80×24 and 120×36 sizes has a trend whose dots rise monotonically to the right, a baseline that
stays visible over the allocated band, a band (not scattered points) for a sawtooth sampled
faster than the columns, a y-axis fitted to the leak's regime, and fewer series when short."""

from __future__ import annotations

import itertools
import math

import pytest

from memtop.figures.units import GiB, MiB
from memtop.ui import braille
from memtop.ui.view import Detail, Series
from memtop.ui.widgets.history_chart import chart_lines, drawn_series, y_range


def _leak_detail(samples: int = 1200) -> Detail:
    """20 min at 1 Hz: warm-up at 0 for 60 s, then a baseline growing 8 MiB/s from 10 GiB, a
    sawtooth of 3 GiB a step on top (sampled at random phases), reserved and peak above."""
    xs, alloc_hi, alloc_lo, reserved, peak = [], [], [], [], []
    marks_x, marks_y = [], []
    for i in range(samples):
        t = float(i - samples + 1)
        base = 0.0 if i < 60 else 10 * GiB + 8 * MiB * (i - 60)
        saw = 3 * GiB * ((i * 0.37) % 1.0)
        xs.append(t)
        alloc_hi.append(base + saw)
        alloc_lo.append(base + saw)
        reserved.append(base + 4 * GiB if i >= 60 else 0.0)
        peak.append(base + 3.2 * GiB if i >= 60 else 0.0)
        if i >= 60:
            marks_x.append(t)
            marks_y.append(base + 5 * MiB * math.sin(i))
    trend = Series("leak trend", (marks_x[0], marks_x[-1]), (marks_y[0], marks_y[-1]))
    series = (
        Series("reserved", tuple(xs), tuple(reserved)),
        Series("peak", tuple(xs), tuple(peak)),
        Series("allocated", tuple(xs), tuple(alloc_hi), lows=tuple(alloc_lo)),
        Series("baseline", tuple(marks_x), tuple(marks_y)),
    )
    return Detail(None, series, trend, None, (), "", 1_800_000_000.0)  # type: ignore[arg-type]


def _render(detail: Detail, cols: int, rows: int) -> braille.Chart:
    series = drawn_series(detail, rows)
    low, high, _ = y_range(detail, series)
    oldest = min(min(s.xs) for s in series)
    lines = [
        braille.Line(s.name, s.xs, s.ys, "#fff", lows=s.lows, points=s.name == "baseline")
        for s in series
    ]
    return braille.render(lines, cols, rows, (oldest, 0.0), (low, high))


@pytest.mark.parametrize("cols, rows", [(64, 5), (100, 14)])  # ~80×24 and ~120×36
def test_the_trend_rises_and_the_baseline_stays_visible(cols: int, rows: int):
    chart = _render(_leak_detail(), cols, rows)
    trend = sorted(chart.pixels("leak trend"))
    assert len(trend) >= cols  # a line across the regime, not two dots
    heights = [y for _, y in trend]  # dot rows: 0 at the top, so rising means not increasing
    assert all(b <= a for a, b in itertools.pairwise(heights)), heights
    assert heights[0] - heights[-1] >= rows * 4 // 3  # a visible slope
    baseline = chart.pixels("baseline")
    assert len(chart.visible("baseline")) / len(baseline) > 0.95


def test_a_sawtooth_faster_than_the_columns_is_a_band():
    chart = _render(_leak_detail(), 100, 14)
    band = chart.pixels("allocated")
    columns = {x for x, _ in band}
    assert len(columns) >= 190  # every dot column of the 200 has its span
    tall = [x for x in columns if sum(1 for c, _ in band if c == x) >= 4]
    assert len(tall) > 0.8 * len(columns)  # spans, not one dot per column


def test_the_y_axis_starts_at_the_leaks_regime_not_the_warm_up():
    detail = _leak_detail()
    low, high, cut = y_range(detail, drawn_series(detail, 14))
    assert cut and 8 * GiB < low < 10 * GiB and high > 19 * GiB  # a margin under 10 GiB
    no_leak = Detail(None, detail.series, None, None, (), "", detail.newest)  # type: ignore[arg-type]
    assert y_range(no_leak, drawn_series(no_leak, 14))[:2][0] == 0.0


def test_a_short_chart_draws_fewer_series_and_its_rows_fit():
    detail = _leak_detail()
    assert [s.name for s in drawn_series(detail, 14)] == [
        "reserved", "peak", "allocated", "leak trend", "baseline"
    ]  # fmt: skip
    assert [s.name for s in drawn_series(detail, 6)] == [
        "reserved", "allocated", "leak trend", "baseline"
    ]  # fmt: skip
    assert [s.name for s in drawn_series(detail, 3)] == ["allocated", "leak trend", "baseline"]
    for width, height in ((78, 6), (118, 15)):
        lines = chart_lines(detail, width, height)
        assert len(lines) == height
        assert all(line.cell_len <= width for line in lines), [line.cell_len for line in lines]


def test_the_series_colours_are_drawn_at_full_strength_not_dimmed_with_the_axis():
    """The y-axis labels are dim; the dots beside them are not (a dim base style on the row
    faded every series' colour: the chart read as grey, the legend's colours did not match)."""
    from rich.console import Console

    console = Console(color_system="truecolor")
    lines = chart_lines(_leak_detail(), 100, 14)
    plotted = 0
    for line in lines[:-1]:  # the x-axis row is all labels
        for offset, char in enumerate(line.plain):
            if "\u2800" < char <= "\u28ff":
                style = line.get_style_at_offset(console, offset)
                assert not style.dim, (offset, char, style)
                plotted += 1
    assert plotted > 100
