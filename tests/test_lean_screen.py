"""memtop.ui.lean_screen: a frame renders only the widgets that paint where something changed,
and the terminal ends up showing what a full frame shows."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from rich.color import ColorSystem
from textual.app import App, ComposeResult
from textual.containers import Vertical
from textual.geometry import Region
from textual.screen import Screen
from textual.widgets import Static
from ui_helpers import full_frame, play_into_terminal, steps_moved

from memtop.ui.cell_diff import CellDiff
from memtop.ui.lean_screen import LeanCompositor, LeanScreen

RENDERS: Counter[str] = Counter()

SGR = re.compile(r"\x1b\[[0-9;]*m")  # a style (select graphic rendition)


class Counted(Static):
    def render_lines(self, crop):  # type: ignore[no-untyped-def]
        RENDERS[str(self.id)] += 1
        return super().render_lines(crop)


class Played(App[None]):
    """An app drawn on a LeanScreen (`lean`; else Textual's Screen), every update it writes
    played into a terminal (`terminal`: what a terminal fed every update shows)."""

    screen_class: type[Screen[None]] = LeanScreen

    def __init__(self, lean: bool = True) -> None:
        super().__init__()
        self.lean = lean
        self.terminal = play_into_terminal(self)

    def get_default_screen(self) -> Screen[None]:
        return self.screen_class(id="_default") if self.lean else Screen(id="_default")


class Board(Played):
    """A header, a box of three lines of which one changes, a footer: the dashboard's shape."""

    CSS = "#box { height: 5; border: round white; } Counted { height: 1; }"

    def compose(self) -> ComposeResult:
        yield Counted("memtop  host  8 GPUs", id="head")
        with Vertical(id="box"):
            yield Counted("GPU 0  38.7 GiB", id="a")
            yield Counted("step 0", id="step")
            yield Counted("GPU 1  12.0 GiB", id="b")
        yield Counted("q Quit", id="foot")


async def run_board(lean: bool) -> tuple[Board, Counter[str], CellDiff]:
    app = Board(lean)
    async with app.run_test(size=(40, 10)) as pilot:
        await pilot.pause()
        RENDERS.clear()
        for step in range(1, 6):
            app.query_one("#step", Static).update(f"step {step}")
            await pilot.pause(0.05)
        renders = Counter(RENDERS)
        whole = full_frame(app)  # the screen as one full frame, for comparison
    return app, renders, whole


def test_the_dashboard_uses_the_lean_screen():
    from memtop.engine.store import Store
    from memtop.ui.app import MemtopApp

    screen = MemtopApp(Store(), None).get_default_screen()
    assert isinstance(screen._compositor, LeanCompositor)


@pytest.mark.parametrize("lean", [True, False])
def test_a_change_renders_only_what_paints_there_and_the_screen_matches_a_full_frame(lean):
    app, renders, whole = asyncio.run(run_board(lean))
    assert renders["step"] >= 5  # each change was drawn
    if lean:
        # Neither the header, the footer nor the box's other lines were rendered again.
        assert renders["head"] == renders["foot"] == renders["a"] == renders["b"] == 0
    else:  # Textual's compositor: what the lean one spares (the test can tell them apart)
        assert renders["head"] >= 5 and renders["foot"] >= 5
    assert app.terminal.cells == whole.cells
    assert any(char == "5" for char, _ in app.terminal.cells.values())  # "step 5" is shown


def test_a_step_that_moved_repaints_its_cells_not_the_rows():
    """STEP moves on every row each second: the frame carries those cells (the table's dirty
    region is the STEP column, and only its cells are written), and the terminal still shows
    what a full frame shows."""

    from ui_frozen import MY_UID, NOW, frozen_store

    from memtop.ui.app import MemtopApp

    app = MemtopApp(frozen_store(), None, clock=lambda: NOW, host="gpu-box", my_uid=MY_UID)
    terminal = play_into_terminal(app)

    async def run() -> tuple[list[Region], CellDiff]:
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.3)
            table = app.table
            rows = tuple(row for row in table.source if row.step is not None)
            assert len(rows) >= 3  # the trainers with agents
            regions: list[Region] = []
            refresh = table.refresh

            def record(*args, **kwargs):  # type: ignore[no-untyped-def]
                regions.extend(args)
                return refresh(*args, **kwargs)

            table.refresh = record  # type: ignore[method-assign]
            feed = terminal.feed

            def keep(data: str) -> None:
                sent.append(data)
                feed(data)

            terminal.feed = keep  # type: ignore[method-assign]
            # Settled first: on a loaded box the footer's bindings can still be drawing (three
            # footer repaints were counted against the STEP cells once in CI).
            for _ in range(20):
                sent.clear()
                await pilot.pause(0.2)
                if not sent:
                    break
            regions.clear()
            table.show(
                steps_moved(table),
                False,
                True,  # a round that shows every figure anew (the steps move every STEP_S)
            )
            await pilot.pause(0.2)
            table.refresh = refresh  # type: ignore[method-assign]
            terminal.feed = feed  # type: ignore[method-assign]
            return regions, full_frame(app)

    sent: list[str] = []
    regions, whole = asyncio.run(run())
    assert regions and sum(region.height for region in regions) >= 3
    assert all(region.width <= 8 for region in regions), regions  # STEP, not the rows
    # What went to the terminal: a cursor move, a style and a digit or two per row (Textual's
    # own update wrote each row from the table's left edge: 363 bytes here, against 66).
    # Counted apart from the styles, whose length is the colour depth's (Rich keeps a style's
    # codes from its first render: after another app's truecolor screenshot, 138 bytes).
    written = "".join(sent)
    rows = sum(region.height for region in regions)
    assert len(SGR.sub("", written)) <= 14 * rows, written
    assert len(SGR.findall(written)) <= 2 * rows, written
    assert terminal.cells == whole.cells


def test_changes_far_apart_render_only_the_widgets_that_changed_not_the_box_between():
    """The header and the footer change in one frame: the box around both is the whole screen,
    yet only those two lines are rendered (Textual rendered every widget in the box: the GPU
    cards and the table each time a STEP cell and the status line changed together)."""
    app = Board(lean=True)

    async def run() -> tuple[Counter[str], object]:
        async with app.run_test(size=(40, 10)) as pilot:
            await pilot.pause()
            RENDERS.clear()
            for step in range(1, 4):
                app.query_one("#head", Static).update(f"memtop  host  {step} GPUs")
                app.query_one("#foot", Static).update(f"q Quit {step}")
                await pilot.pause(0.05)
            renders = Counter(RENDERS)
            return renders, full_frame(app)

    renders, whole = asyncio.run(run())
    assert renders["head"] >= 3 and renders["foot"] >= 3
    assert renders["a"] == renders["step"] == renders["b"] == 0, renders
    assert app.terminal.cells == whole.cells  # type: ignore[attr-defined]
    assert any(char == "3" for char, _ in app.terminal.cells.values())


def test_a_tall_widget_renders_only_its_dirty_lines():
    """One line of a ten-line widget changes: that line is rendered, not the other nine, and
    the terminal shows what a full frame shows."""
    crops: list[Region] = []

    class Tall(Static):
        def render_lines(self, crop):  # type: ignore[no-untyped-def]
            crops.append(crop)
            return super().render_lines(crop)

    class Page(Played):
        CSS = "Tall { height: 10; }"

        def compose(self) -> ComposeResult:
            yield Static("head", id="head")
            yield Tall("\n".join(f"line {i}" for i in range(10)), id="tall")

    app = Page()

    async def run() -> tuple[list[Region], object]:
        async with app.run_test(size=(30, 12)) as pilot:
            await pilot.pause()
            tall = app.query_one(Tall)
            crops.clear()
            tall.refresh(Region(0, 4, 6, 1))  # line 4's first cells, as a table cell's refresh
            await pilot.pause(0.05)
            rendered = list(crops)
            return rendered, full_frame(app)

    rendered, whole = asyncio.run(run())
    assert rendered and all(crop.height == 1 and crop.y == 4 for crop in rendered), rendered
    assert app.terminal.cells == whole.cells  # type: ignore[attr-defined]


def test_the_lean_screen_keeps_rich_and_textual_line_caches_bounded():
    """Issue 36 item 10: Rich's and Textual's caches keyed by a line's content (16,384 entries
    each) grew for most of an hour on a dashboard whose figures change every second; Rich's
    cached_cell_len (4,096) in an hour or two (issue 35 item 8)."""
    from rich.cells import cached_cell_len
    from rich.segment import Segment
    from rich.style import Style
    from textual.strip import Strip

    from memtop.ui import lean_screen

    bound = getattr(lean_screen, "TEXT_CACHE_ENTRIES", 2048)
    split_cells = vars(Segment)["_split_cells"].__func__  # this Rich's
    render_ansi = vars(Strip)["render_ansi"].__func__  # this Textual's
    for n in range(3 * bound):  # lines and styles a dashboard drew, all distinct
        style = Style(color=f"#{n:06x}")
        Segment(f"漢 step {n} │ 38.7 GiB", style).split_cells(5)
        Strip.render_ansi(style, ColorSystem.TRUECOLOR)
        cached_cell_len(f"  {n / 7:.1f} GiB stuck in splits")  # (Rich's: 4,096 at most)
    assert split_cells.cache_info().currsize > bound < render_ansi.cache_info().currsize
    assert cached_cell_len.cache_info().currsize > bound

    async def frames() -> None:
        app = Board(lean=True)
        async with app.run_test(size=(40, 10)) as pilot:
            for step in range(3):
                app.query_one("#step", Static).update(f"漢 step {step}")
                await pilot.pause(0.05)

    asyncio.run(frames())
    assert split_cells.cache_info().currsize <= bound
    assert render_ansi.cache_info().currsize <= bound
    assert cached_cell_len.cache_info().currsize <= bound


class CountedBox(Vertical):
    def render_lines(self, crop):  # type: ignore[no-untyped-def]
        RENDERS[str(self.id)] += crop.height  # lines, not calls
        return super().render_lines(crop)


class CountedScreen(LeanScreen):
    def render_lines(self, crop):  # type: ignore[no-untyped-def]
        RENDERS["screen"] += crop.height
        return super().render_lines(crop)


class Boxed(Played):
    """The dashboard's nesting: a container with a border round widgets that change."""

    CSS = "#box { height: 5; border: round white; } Static { height: 1; }"
    screen_class = CountedScreen

    def compose(self) -> ComposeResult:
        yield Static("memtop  host  8 GPUs", id="head")
        with CountedBox(id="box"):
            yield Static("GPU 0  38.7 GiB", id="a")
            yield Static("step 0", id="step")
            yield Static("GPU 1  12.0 GiB", id="b")
        yield Static("q Quit", id="foot")


def test_a_container_under_its_changed_children_draws_none_of_their_lines():
    """A partial update draws a container's lines only where a dirty cell is its own (its
    border): under a child that changed, the container's line was drawn and then covered, as
    was the screen's (a third of the dashboard's lines drawn in the mixed demo, issue 35)."""
    app = Boxed()

    async def run() -> tuple[Counter[str], Counter[str], object]:
        async with app.run_test(size=(40, 10)) as pilot:
            await pilot.pause()
            RENDERS.clear()
            for step in range(1, 4):
                app.query_one("#step", Static).update(f"step {step}")
                app.query_one("#head", Static).update(f"memtop  host  {step} GPUs")
                await pilot.pause(0.05)
            under = Counter(RENDERS)
            RENDERS.clear()
            app.query_one("#box").border_title = "GPUs"  # the box's own cells this time
            await pilot.pause(0.05)
            own = Counter(RENDERS)
            return under, own, full_frame(app)

    under, own, whole = asyncio.run(run())
    assert under["box"] == under["screen"] == 0, under
    assert own["box"] >= 1, own
    assert app.terminal.cells == whole.cells  # type: ignore[attr-defined]
    assert any(char == "3" for char, _ in app.terminal.cells.values())
    assert any(char == "U" for char, _ in app.terminal.cells.values())  # the title: "GPUs"


def test_each_partial_update_of_the_dashboard_writes_what_textuals_rendering_would(monkeypatch):
    """Byte for byte: every partial update the dashboard makes (a STEP moved, a figure, the
    cursor, focus and highlight) writes what rendering every widget in the update's box, as
    Textual's compositor does, and writing the same dirty spans would."""

    from ui_frozen import MY_UID, NOW, frozen_store

    from memtop.ui import lean_screen
    from memtop.ui.app import MemtopApp
    from memtop.ui.lean_screen import SpanUpdate

    updates: list[tuple[str, str]] = []

    class Checked(LeanCompositor):
        def render_partial_update(self):  # type: ignore[no-untyped-def]
            regions = set(self._dirty_regions)
            update = super().render_partial_update()
            if update is None or not regions:
                return update
            console = app.console  # the app's, made below
            crop = Region.from_union(list(regions)).intersection(self.size.region)
            spans = list(self._regions_to_spans(regions))
            rows = {y for y, _, _ in spans}
            # Outside an update: _get_renders is Textual's own, every widget in the box.
            chops = self._render_chops(crop, rows.__contains__)
            chop_ends = [cut_set[1:] for cut_set in self.cuts]
            textual = SpanUpdate(chops, spans, chop_ends).render_segments(console)
            updates.append((update.render_segments(console), textual))
            return update

    monkeypatch.setattr(lean_screen, "LeanCompositor", Checked)
    app = MemtopApp(frozen_store(), None, clock=lambda: NOW, host="gpu-box", my_uid=MY_UID)

    async def run() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.3)
            assert isinstance(app.screen._compositor, Checked)
            table = app.table
            for _ in range(3):
                table.show(
                    steps_moved(table),
                    False,
                    True,
                )
                await pilot.pause(0.1)
            for key in ("down", "down", "up", "tab", "down", "tab", "tab"):
                await pilot.press(key)
                await pilot.pause(0.1)

    asyncio.run(run())
    assert len(updates) >= 8, len(updates)
    for lean, textual in updates:
        assert lean == textual


def test_a_span_is_written_as_a_cut_strip_would_write_it():
    """render_cells writes what Strip.crop then Strip.render write, at every cut of strips
    with styled, unstyled, empty and linked segments."""
    from rich.console import Console
    from rich.segment import Segment
    from rich.style import Style
    from textual.strip import Strip

    from memtop.ui.lean_screen import _one_cell_each, render_cells

    console = Console(color_system="truecolor", force_terminal=True)
    link = Style(color="cyan", link="https://example.com/x")
    strips = [
        Strip(
            [
                Segment(" 4102 ", Style(bold=True)),
                Segment("", Style(color="red")),
                Segment("alice", None),
                Segment("  38.7G ", Style(color="#ff8800", bgcolor="black")),
                Segment("", None),
                Segment("step 1234", link),
                Segment(" ", Style()),
            ]
        ),
        Strip([Segment("x", Style(italic=True))]),
        Strip([Segment("ab", None), Segment("cd", None)]),
        Strip(
            [
                Segment(" python train.py --conf… ", None),
                Segment("│", Style(dim=True)),
                Segment(" ██▌   ", Style(color="green")),
                Segment("⠁⠃⠇ · → ▾", Style(bold=True)),
            ]
        ),
    ]
    compared = 0
    for strip in strips:
        width = strip.cell_length
        for start in range(width):
            for stop in range(start + 1, width + 1):
                assert render_cells(strip, start, stop, console) == strip.crop(start, stop).render(
                    console
                ), (start, stop)
                compared += 1
    assert compared > 1000
    assert all(_one_cell_each(strip.text) for strip in strips)
    for wide in ("漢", "e\u0301", "a\u200db", "\U0001f1e6\U0001f1e7", "x\x1by"):
        assert not _one_cell_each(wide), wide  # cut as Textual cuts it


def test_a_span_inside_a_line_is_written_without_cutting_a_strip(monkeypatch):
    """A STEP cell of a table row: the update writes those cells of the row's strip without
    a Strip.crop (which measured and copied the row, a twentieth of the dashboard's samples),
    and the terminal shows what a full frame shows."""
    from textual.strip import Strip

    from memtop.ui.lean_screen import SpanUpdate

    class Page(Played):
        CSS = "Static { height: 3; }"

        def compose(self) -> ComposeResult:
            yield Static("GPU 0  38.7 GiB  step 1\nGPU 1  12.0 GiB… step 2\n漢字 step 3", id="rows")

    crops = [0]
    writing = [False]
    crop, render_segments = Strip.crop, SpanUpdate.render_segments

    def counted_crop(self, start, end=None):  # type: ignore[no-untyped-def]
        crops[0] += writing[0]
        return crop(self, start, end)

    def counted_render(self, console):  # type: ignore[no-untyped-def]
        writing[0] = True
        try:
            return render_segments(self, console)
        finally:
            writing[0] = False

    monkeypatch.setattr(Strip, "crop", counted_crop)
    monkeypatch.setattr(SpanUpdate, "render_segments", counted_render)
    app = Page()

    async def run() -> tuple[int, int, object]:
        async with app.run_test(size=(30, 5)) as pilot:
            await pilot.pause()
            rows = app.query_one("#rows", Static)
            rows.update("GPU 0  38.7 GiB  step 7\nGPU 1  12.0 GiB… step 8\n漢字 step 9")
            await pilot.pause(0.05)  # (the whole widget: nothing to cut)
            crops[0] = 0
            rows.refresh(Region(21, 0, 2, 2))  # two rows' STEP cells, one cell a character
            await pilot.pause(0.05)
            ascii_crops = crops[0]
            crops[0] = 0
            rows.refresh(Region(8, 2, 2, 1))  # a row with wide characters: cut as Textual cuts
            await pilot.pause(0.05)
            return ascii_crops, crops[0], full_frame(app)

    ascii_crops, wide_crops, whole = asyncio.run(run())
    assert ascii_crops == 0
    assert wide_crops >= 1  # from the chop's start, cut as Textual cuts it
    assert app.terminal.cells == whole.cells  # type: ignore[attr-defined]


def _dashboard_rounds(rounds: int, after: Callable[[int, Any], None]) -> None:
    """The dashboard at 120x36 on 11 simulated trainers (8 healthy, 2 leaking, 1 fragmenting),
    each round shown and its frame drawn, then `after(round, app)`."""
    from test_churn_bounds import _round
    from ui_frozen import MY_UID, T0, Trainer

    from memtop.engine.store import Store
    from memtop.ui.app import MemtopApp

    kinds = ("healthy",) * 8 + ("leak", "fragment", "leak")
    trainers = [Trainer(5000 + i, i % 2, kind) for i, kind in enumerate(kinds)]
    clock = [T0]
    store = Store(history=40, step_marks=80)
    app = MemtopApp(store, None, clock=lambda: clock[0], my_uid=MY_UID)

    async def run() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            for k in range(1, rounds + 1):
                clock[0] = T0 + k + 0.5
                _round(store, k, trainers, [])
                app.refresh_view()
                await pilot.pause(0)
                after(k, app)

    asyncio.run(run())


def test_the_lean_compositors_chops_are_textuals():
    """LeanCompositor._render_chops (a line that is one chop whole taken as it is) gives every
    line the same chops, strip for strip, as Textual's own, for a full frame and for a few
    lines (it repeats Textual's loop: should Textual's change, this says so)."""
    from textual._compositor import Compositor

    checked: set[int] = set()

    def compare(k: int, app: Any) -> None:
        if k < 3:
            return
        compositor = app.screen._compositor
        assert isinstance(compositor, LeanCompositor)
        full = compositor.size.region
        for crop, rows in ((full, None), (Region(0, 2, 120, 12), {3, 4, 9, 12})):

            def drawn(y: int, rows: set[int] | None = rows) -> bool:
                return rows is None or y in rows

            ours = compositor._render_chops(crop, drawn)
            textuals = Compositor._render_chops(compositor, crop, drawn)
            assert len(ours) == len(textuals)
            for line, (mine, theirs) in enumerate(zip(ours, textuals, strict=True)):
                assert list(mine) == list(theirs), line
                for cut, strip in mine.items():
                    other = theirs[cut]
                    assert (strip is None) == (other is None), (line, cut)
                    if strip is not None and other is not None:
                        assert list(strip) == list(other), (line, cut)
                        checked.add(line)

    _dashboard_rounds(3, compare)
    assert len(checked) >= 30  # the whole screen's lines compared, not an empty map


def test_a_dashboard_round_leaves_no_strip_to_the_cyclic_collector():
    """A line drawn anew is freed by reference counting: the dashboard runs the cyclic
    collector rarely (memtop.ui.app: GC_GEN0_THRESHOLD), and what waits for it is moved to older
    generations that only a full collection walks.  Textual's `Strip.divide`, asked to divide
    a line into one chop, keeps `[strip]` in the strip's own cache: 9 strips a round in this
    dashboard, 3,404 objects in 20 rounds with their caches and segments (issue 35 item 8)."""
    import gc

    from textual.strip import Strip

    was_on = gc.isenabled()
    left: list[object] = []

    def watch(k: int, app: Any) -> None:
        if k == 40:  # the rings full, every widget drawn: watch the next 20 rounds
            gc.collect()
            gc.disable()
        elif k == 60:
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                gc.collect()
                left.extend(gc.garbage)
            finally:
                gc.set_debug(0)
                gc.garbage.clear()

    try:
        _dashboard_rounds(60, watch)
    finally:
        if was_on:
            gc.enable()
    strips = [o for o in left if isinstance(o, Strip)]
    kinds = Counter(type(o).__name__ for o in left).most_common(8)
    assert not strips, f"{len(strips)} strips left to the collector: {kinds}"
    assert len(left) < 100, kinds
