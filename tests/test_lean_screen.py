"""memtop.ui.lean_screen: a frame renders only the widgets that paint where something changed,
and the terminal ends up showing what a full frame shows."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from textual._compositor import CompositorUpdate
from textual.app import App, ComposeResult
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Static

from memtop.ui.cell_diff import CellDiff
from memtop.ui.lean_screen import LeanCompositor, LeanScreen

RENDERS: Counter[str] = Counter()


class Counted(Static):
    def render_lines(self, crop):  # type: ignore[no-untyped-def]
        RENDERS[str(self.id)] += 1
        return super().render_lines(crop)


class Board(App[None]):
    """A header, a box of three lines of which one changes, a footer: the dashboard's shape."""

    CSS = "#box { height: 5; border: round white; } Counted { height: 1; }"

    def __init__(self, lean: bool) -> None:
        super().__init__()
        self.lean = lean
        self.terminal = CellDiff()  # what a terminal fed every update would show

    def get_default_screen(self) -> Screen[None]:
        return LeanScreen(id="_default") if self.lean else Screen(id="_default")

    def compose(self) -> ComposeResult:
        yield Counted("memtop  host  8 GPUs", id="head")
        with Vertical(id="box"):
            yield Counted("GPU 0  38.7 GiB", id="a")
            yield Counted("step 0", id="step")
            yield Counted("GPU 1  12.0 GiB", id="b")
        yield Counted("q Quit", id="foot")

    def _display(self, screen: Screen[object], renderable: object) -> None:
        # Headless apps write nothing: play each update into the terminal model instead.
        if isinstance(renderable, CompositorUpdate):
            self.terminal.feed(renderable.render_segments(self.console))


async def run_board(lean: bool) -> tuple[Board, Counter[str], CellDiff]:
    app = Board(lean)
    async with app.run_test(size=(40, 10)) as pilot:
        await pilot.pause()
        RENDERS.clear()
        for step in range(1, 6):
            app.query_one("#step", Static).update(f"step {step}")
            await pilot.pause(0.05)
        renders = Counter(RENDERS)
        # The screen as one full frame, for comparison.
        whole = CellDiff()
        full = app.screen._compositor.render_update(full=True)
        assert isinstance(full, CompositorUpdate)
        whole.feed(full.render_segments(app.console))
    return app, renders, whole


def test_the_dashboard_uses_the_lean_screen():
    from memtop.store import Store
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
