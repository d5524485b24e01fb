"""The dashboard's one-line graphics, checked cell by cell."""

from __future__ import annotations

from memtop.ui.render import BarEdges, bin_reduce, gauge, memory_bar, short_bytes, sparkline

GiB = 1 << 30


def test_memory_bar_segments_and_peak_mark() -> None:
    bar = memory_bar(
        40, 80 * GiB, allocated=20 * GiB, reserved=30 * GiB, other=10 * GiB, peak=26 * GiB
    )
    assert len(bar.plain) == 40
    # 10 cells allocated, 5 cached, 5 outside PyTorch, 20 free; the peak mark in cell 12.
    assert bar.plain == "█" * 12 + "┃" + "█" * 7 + "·" * 20

    def style_at(cell: int) -> str:
        return next(str(s.style) for s in bar.spans if s.start <= cell < s.end)

    assert [style_at(i) for i in (0, 9, 10, 12, 14, 17, 25)] == [
        "green",
        "green",
        "yellow",
        "bold bright_white",
        "yellow",
        "magenta",
        "bright_black",
    ]


def test_memory_bar_without_agents_shows_driver_usage() -> None:
    bar = memory_bar(10, 10 * GiB, allocated=0, reserved=0, other=None, peak=None, used=5 * GiB)
    assert bar.plain == "█" * 5 + "·" * 5


def test_sparkline_scale_and_alignment() -> None:
    assert sparkline([0, 1, 2, 3], 6, floor=0, span=3) == "  ▁▃▆█"
    # More values than cells: each cell is the minimum of its bin (the baseline, not spikes).
    assert sparkline([0, 9, 0, 9, 3, 9, 3, 9], 4, floor=0, span=3) == "▁▁██"
    assert sparkline([], 3, 0, 1) == "   "


def test_bin_reduce_and_small_helpers() -> None:
    assert bin_reduce(list(range(10)), 5, max) == [1, 3, 5, 7, 9]
    assert bin_reduce([1, 2], 5, min) == [1, 2]
    assert short_bytes(512) == "512B"
    assert short_bytes(30.2 * GiB) == "30.2G"
    assert short_bytes(263 * (1 << 20)) == "263M"
    assert gauge(0.5, 4) == "██  "


def test_a_figure_wavering_across_a_cells_middle_does_not_flip_that_cell() -> None:
    """A sawtooth's allocated bytes at 4.45 and 4.55 cells of 40 flipped the fifth cell between
    allocated and cached every frame; a bar that remembers its edges holds it, and still moves
    when the figure really moves (a whole cell)."""
    total, width = 40 * GiB, 40

    def draw(allocated: float, edges: BarEdges | None) -> str:
        bar = memory_bar(width, total, int(allocated * GiB), 20 * GiB, 0, None, None, edges)
        return "".join(f"{span.style}:{span.end - span.start} " for span in bar.spans)

    wobble = [4.45, 4.55, 4.45, 4.55]
    assert len({draw(a, None) for a in wobble}) == 2  # without edges: the cell flips
    edges = BarEdges()
    assert len({draw(a, edges) for a in wobble}) == 1  # held
    assert draw(5.9, edges) != draw(4.45, BarEdges())  # a real move still moves the edge
    assert draw(5.9, edges) == draw(5.9, None)
    # A bar at another width or total starts afresh (the card was resized).
    assert memory_bar(20, total, int(4.55 * GiB), 0, 0, None, None, edges).plain.count("█") == 2


def _bar_cell_by_cell(width, total, allocated, reserved, other, peak, used, edges):  # type: ignore[no-untyped-def]
    """memory_bar's drawing as it was first written: a glyph and a style a cell, appended run by
    run."""
    from rich.text import Text

    from memtop.ui import render

    text = Text()
    if width <= 0:
        return text
    if not total:
        return Text("·" * width, style=render.FREE)
    # The cells counted as memory_bar counts them (render.bar_cells): what is compared here is
    # how the bar is drawn from them.
    a, c, o, f, mark = render.bar_cells(width, total, allocated, reserved, other, peak, used, edges)
    glyphs = ["█"] * (a + c + o) + ["·"] * f
    styles = [render.ALLOCATED] * a + [render.CACHED] * c + [render.OTHER] * o + [render.FREE] * f
    if mark is not None:
        glyphs[mark] = "┃"
        styles[mark] = render.PEAK
    start = 0
    for i in range(1, width + 1):
        if i == width or styles[i] != styles[start] or glyphs[i] != glyphs[start]:
            text.append("".join(glyphs[start:i]), style=styles[start])
            start = i
    return text


def test_a_memory_bar_is_made_by_runs_at_once_and_reads_as_cell_by_cell(
    monkeypatch: object,
) -> None:
    # Every card's bar is made again each time the card is laid out (most rounds, for its used
    # memory).  It was a glyph and a style a cell, then a Text.append a run, each run cleaned
    # of control codes (a dict look-up a character of a run of █): a third of laying a dense
    # card out.  Now it is its runs, one Text made from them; the same characters and spans.
    import random

    import pytest
    from rich.text import Text

    from memtop.ui import render

    rng = random.Random(8)
    for case in range(3000):
        width = rng.choice([0, 1, 2, 3, 8, 9, 40, 79, 80, 120])
        total = rng.choice([0, None, 80 * GiB, 7, 1000])
        top = (total or 1) * 2

        allocated = rng.randint(0, top // 2)
        reserved = allocated + rng.randint(0, top // 2)
        other, peak, used = (
            rng.choice([0, None, rng.randint(0, top), rng.randint(0, top // 2)]) for _ in range(3)
        )
        mine, theirs = BarEdges(), BarEdges()
        for _ in range(3):  # held edges too: the same bar a round later
            args = (width, total, allocated, reserved, other, peak, used)
            want = _bar_cell_by_cell(*args, theirs if case % 2 else None)
            got = memory_bar(*args, mine if case % 2 else None)
            assert (got.plain, got.spans, got.style) == (want.plain, want.spans, want.style), args
            allocated = max(0, allocated + rng.randint(-top // 8, top // 8))
    appended = [0]
    append = Text.append

    def counted(self: Text, *args, **kwargs):  # type: ignore[no-untyped-def]
        appended[0] += 1
        return append(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Text, "append", counted)
        bar = render.memory_bar(80, 80 * GiB, 20 * GiB, 30 * GiB, 10 * GiB, 26 * GiB)
    assert appended[0] == 0  # (6 before: a run each)
    assert len(bar.spans) == 6 and bar.plain.count("┃") == 1  # the mark cuts the cached run


def test_a_lines_pieces_are_cleaned_of_control_codes_only_where_they_have_any() -> None:
    import pytest

    from memtop.ui.widgets import lines

    cleaned: list[str] = []
    strip = lines.strip_control_codes

    def counted(text: str) -> str:
        cleaned.append(text)
        return strip(text)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lines, "strip_control_codes", counted)
        line = lines.LineText().add("GPU 0  H100 ").add("▕" + "█" * 40, "green").add(" 38.1 GiB")
        assert cleaned == []  # printable pieces (a bar's █ run) are not looked at again
        # A name as a driver or an agent said it: its control codes still go.
        line.add("\x07rogue\rname\x08", "bold")
    assert cleaned == ["\x07rogue\rname\x08"]
    text = line.text()
    assert text.plain == "GPU 0  H100 ▕" + "█" * 40 + " 38.1 GiBroguename"
    assert [(s.start, s.end, s.style) for s in text.spans] == [(12, 53, "green"), (62, 71, "bold")]
