"""What a round costs the dashboard when little changed (issue 35, item 8): the work a round
does is the work its news needs, not a re-layout or redraw of everything."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from textual.widget import Widget
from ui_frozen import MY_UID, NOW, frozen_store
from ui_helpers import screen_text, wait_for

from memtop.ui import app as app_module
from memtop.ui.app import MemtopApp
from memtop.ui.lean_screen import LeanScreen
from memtop.ui.widgets.suggestions import SuggestionsPane


def _count_layouts(monkeypatch: pytest.MonkeyPatch, widget: Widget) -> list[int]:
    """How many times `widget` asks for the screen to be laid out again (each time Textual
    arranges and redraws every widget)."""
    count = [0]
    original = Widget.refresh

    def counted(self: Widget, *regions, **kwargs):  # type: ignore[no-untyped-def]
        if self is widget and kwargs.get("layout"):
            count[0] += 1
        return original(self, *regions, **kwargs)

    monkeypatch.setattr(Widget, "refresh", counted)
    return count


def test_a_new_status_line_repaints_that_line_not_the_screen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The header's and the status line's height is their CSS's (one row): what they say
    # changes no widget's size, so it needs no layout of the screen.  The change here is the
    # real one of every few seconds: an event ("agent 4201 attached") that expires.
    app = MemtopApp(frozen_store(), None, clock=lambda: NOW + 0.5, host="gpu-box", my_uid=MY_UID)

    async def run() -> tuple[str, int, str]:
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.2)
            before = screen_text(app.export_screenshot())
            layouts = _count_layouts(monkeypatch, app.status_line)
            monkeypatch.setattr(app_module, "EVENT_SHOW_S", 0.0)  # the event's time is up
            await wait_for(pilot, lambda: app._shown.get("status") == (" ", []), 10)
            await pilot.pause(0.2)
            return before, layouts[0], screen_text(app.export_screenshot())

    before, layouts, after = asyncio.run(run())
    assert "agent 4201 attached" in before and "agent 4201 attached" not in after
    assert layouts == 0, "the whole screen was laid out again for the status line"


def test_a_reworded_suggestion_is_drawn_without_the_content_pipeline_and_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each slow period the suggestions whose figures moved are drawn again, and all of them
    # after one comes or goes; Textual's content pipeline cost 0.44 ms an option, 0.17 ms
    # through Rich (issue 35 item 8).  The pane draws its prompts (laid out to its width, never
    # wrapped) through Rich: the same characters, colours and text-selection offsets as
    # Textual's strips, cell by cell.
    from textual.visual import Visual
    from textual.widgets import OptionList

    from memtop.ui.widgets.suggestions import SuggestionsPane

    app = MemtopApp(frozen_store(), None, clock=lambda: NOW, host="gpu-box", my_uid=MY_UID)

    def drawn_as(style):  # type: ignore[no-untyped-def]
        # A cell's colours (as RGB: "red" and "color(1)" are one colour) and attributes, not the
        # strip's ANSI: Rich keeps a Style's escape codes in the Style itself, for the colour
        # system it was first drawn in, and the pane's styles are Rich's cached combinations,
        # which a test before this one may have drawn for a 16-colour terminal ("97;40").
        if style is None:
            return None
        rgb = [c.get_truecolor() if c is not None else None for c in (style.color, style.bgcolor)]
        attributes = (style.bold, style.dim, style.italic, style.underline, style.reverse)
        return (*rgb, attributes, style.meta)

    def cells(strips):  # type: ignore[no-untyped-def]
        return [[(ch, drawn_as(seg.style)) for seg in strip for ch in seg.text] for strip in strips]

    async def run() -> tuple[int, int, str]:
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.2)
            pane = app.query_one(SuggestionsPane)
            assert len(pane.options) >= 3
            compared = 0
            for highlighted in (False, True):
                parts = ("option-list--option-highlighted",) if highlighted else ()
                style = pane.get_visual_style("option-list--option", *parts)
                for option in pane.options:
                    pane._option_render_cache.clear()
                    textual_strips = OptionList._get_option_render(pane, option, style)
                    pane._option_render_cache.clear()
                    assert cells(pane._get_option_render(option, style)) == cells(textual_strips)
                    compared += 1
            pane._option_render_cache.clear()
            pane.refresh()
            await pilot.pause(0.2)
            drawn = [0]
            to_strips = Visual.to_strips.__func__  # type: ignore[attr-defined]

            def counted(cls, widget, *args, **kwargs):  # type: ignore[no-untyped-def]
                if widget is pane:
                    drawn[0] += 1
                return to_strips(cls, widget, *args, **kwargs)

            monkeypatch.setattr(Visual, "to_strips", classmethod(counted))
            # A figure moved: the leak's prompt worded again, drawn again.
            item = pane.items[0]
            prompt = pane._prompts[0].copy()
            prompt.plain = prompt.plain.replace("49 min", "48 min")
            pane._prompts[0] = prompt
            pane.replace_option_prompt_at_index(0, prompt)
            await pilot.pause(0.3)
            assert item is pane.items[0]
            return compared, drawn[0], screen_text(app.export_screenshot())

    compared, drawn, text = asyncio.run(run())
    assert compared >= 6
    assert "full in ~48 min" in text
    assert drawn == 0, "the reworded suggestion went through Textual's content pipeline"


def test_a_new_set_of_suggestions_is_measured_and_drawn_without_the_content_pipeline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A suggestion that comes or goes rebuilds the pane's options, and Textual measured each
    # one (its height) through its content pipeline, 0.2 ms an option, every few seconds in the
    # `mixed` demo (issue 35 item 8).  The pane's prompts are one row per line: their height is
    # their number of lines, the very height Textual measures, and the pane shows the new set.
    from textual.content import Content
    from textual.widgets import _option_list

    from memtop.ui.widgets.suggestions import LaidOutPrompt, SuggestionsPane

    app = MemtopApp(frozen_store(), None, clock=lambda: NOW, host="gpu-box", my_uid=MY_UID)

    async def run() -> tuple[list[tuple[int, int]], int, str, str]:
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.2)
            pane = app.query_one(SuggestionsPane)
            width = pane.scrollable_content_region.width - pane._get_left_gutter_width()
            heights = []
            for option in pane.options:
                assert isinstance(option._visual, LaidOutPrompt)
                textual_visual = Content.from_rich_text(option.prompt, console=app.console)
                for w in (width, width - 20, 30):
                    heights.append(
                        (
                            option._visual.get_height(pane.styles, w),
                            textual_visual.get_height(pane.styles, w),
                        )
                    )
            made = [0]
            visualize = _option_list.visualize

            def counted(widget, *args, **kwargs):  # type: ignore[no-untyped-def]
                if widget is pane:
                    made[0] += 1
                return visualize(widget, *args, **kwargs)

            monkeypatch.setattr(_option_list, "visualize", counted)
            before = screen_text(app.export_screenshot())
            gone = pane.items[0]
            pane.show(pane.items[1:], False)  # the leak's suggestion went
            await pilot.pause(0.3)
            assert gone not in pane.items
            return heights, made[0], before, screen_text(app.export_screenshot())

    heights, made, before, after = asyncio.run(run())
    assert heights and all(ours == textual for ours, textual in heights), heights
    assert "Leak: +8.0 MiB per step" in before and "Leak: +8.0 MiB per step" not in after
    assert made == 0, "the new set of suggestions went through Textual's content pipeline"


def test_a_suggestion_that_comes_or_goes_redraws_the_pane_not_the_screen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A new suggestion (and one gone) changes the pane's number of lines, not its size (its
    # height is its box's): the screen keeps its layout, and the pane shows the change at once.
    # A list that outgrows the pane needs its scrollbar placed: that one is laid out.
    app = MemtopApp(frozen_store(), None, clock=lambda: NOW + 0.5, host="gpu-box", my_uid=MY_UID)

    async def run() -> tuple[int, int, int, str, str, bool]:
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.2)
            assert isinstance(app.screen, LeanScreen)
            pane = app.query_one(SuggestionsPane)
            items = app.dashboard.suggestions  # type: ignore[union-attr]
            assert len(items) >= 2, items
            layouts = _count_layouts(monkeypatch, pane)
            pane.show(items[:1], False, True)
            await pilot.pause(0.2)
            one = screen_text(app.export_screenshot())
            after_fewer = layouts[0]
            pane.show(items, False, True)
            await pilot.pause(0.2)
            after_more = layouts[0]
            every = screen_text(app.export_screenshot())
            many = _more_than_fit(items)
            pane.show(many, False, True)
            await pilot.pause(0.2)
            return after_fewer, after_more, layouts[0], one, every, pane.show_vertical_scrollbar

    fewer, more, overflow, one, every, scrollbar = asyncio.run(run())
    title = app.dashboard.suggestions[1].title  # type: ignore[union-attr]
    assert title[:40] not in one and title[:40] in every  # shown at once, both ways
    assert (fewer, more) == (0, 0), "the whole screen was laid out again for the pane's lines"
    assert scrollbar and overflow >= 1  # its scrollbar's place is the layout's


def _more_than_fit(items):  # type: ignore[no-untyped-def]
    """Six copies of each suggestion item, each its own key: more lines than the pane holds."""
    return tuple(
        dataclasses.replace(item, key=f"{item.key}#{copy}") for copy in range(6) for item in items
    )


def _a_word(title: str) -> str:
    """The first word of letters in a suggestion's title."""
    return next(word for word in title.split() if word.isalpha())


def test_a_reworded_suggestion_repaints_the_cells_that_changed_not_the_pane() -> None:
    # Each slow period a suggestion whose figures moved is worded again: the pane repainted
    # all of itself for it (its every option, its border, its scrollbar: 59 repaints in 29 s of
    # the mixed demo, issue 35 item 8), then all of that option's lines across the pane, its
    # scrollbar's column too (the scrollbar drew again with each: 39 lines in 30 s), where a
    # figure in one of its lines is what changed.  Now: the cells that moved in the lines that
    # changed (a line whose length changed: that line across the text), never the scrollbar.
    # Scrolled or not, the terminal then shows what a full frame of the screen shows.
    from textual.geometry import Region
    from textual.scrollbar import ScrollBar
    from ui_helpers import full_frame, play_into_terminal

    app = MemtopApp(frozen_store(), None, clock=lambda: NOW + 0.5, host="gpu-box", my_uid=MY_UID)
    terminal = play_into_terminal(app)
    regions: list[list[Region]] = []
    drawn: list[Region] = []
    scrollbar_lines = [0]

    class Watched(SuggestionsPane):
        def refresh(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            regions.append(list(args))
            return super().refresh(*args, **kwargs)

        def render_lines(self, crop):  # type: ignore[no-untyped-def]
            drawn.append(crop)
            return super().render_lines(crop)

    class CountedBar(ScrollBar):
        def render_lines(self, crop):  # type: ignore[no-untyped-def]
            scrollbar_lines[0] += crop.height
            return super().render_lines(crop)

    def reword(pane: SuggestionsPane, index: int, old: str, new: str) -> tuple[int, int, int]:
        """The option's prompt with `old` made `new`; the pane's line where it is (in the
        pane's own coordinates, under its border) and the cells [x0, x1) that differ there."""
        prompt = pane._prompts[index].copy()
        assert old in prompt.plain, prompt.plain
        before = prompt.plain.split("\n")
        prompt.plain = prompt.plain.replace(old, new, 1)
        after = prompt.plain.split("\n")
        line = next(y for y, (a, b) in enumerate(zip(before, after, strict=True)) if a != b)
        a, b = before[line], after[line]
        differ = [x for x in range(max(len(a), len(b))) if a[x : x + 1] != b[x : x + 1]]
        pane._prompts[index] = prompt
        regions.clear()
        drawn.clear()
        scrollbar_lines[0] = 0
        pane.replace_option_prompt_at_index(index, prompt)
        first = pane.content_offset.y + pane._index_to_line[index] - pane.scroll_offset.y
        return first + line, differ[0], differ[-1] + 1

    text_width = 120 - 4 - 2  # less its borders and padding, and its scrollbar's gutter (right)

    async def run() -> list[tuple[int, int, int, list[list[Region]], list[Region], int, bool]]:
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.2)
            pane = app.query_one(SuggestionsPane)
            pane.__class__ = Watched  # the same pane, its repaints recorded
            assert pane.scrollable_content_region.width == text_width
            seen = []

            def same_as_full() -> bool:  # (a full frame draws every line: counted no more)
                pane.__class__ = SuggestionsPane
                try:
                    return terminal.cells == full_frame(app).cells
                finally:
                    pane.__class__ = Watched

            items = pane.items
            assert len(items) >= 2, items
            word = _a_word(items[1].title)
            y, x0, x1 = reword(pane, 1, word, word.swapcase())  # as long: cells in place
            await pilot.pause(0.2)
            seen.append((y, x0, x1, regions[:], drawn[:], scrollbar_lines[0], same_as_full()))
            # Scrolled: a longer list (its scrollbar shown), three lines down, its fourth
            # option reworded, once in place and once a word longer (the line across).
            many = _more_than_fit(items)
            pane.show(many, False, True)
            await pilot.pause(0.2)
            pane.scroll_to(y=3, animate=False, immediate=True)
            await pilot.pause(0.2)
            assert pane.scroll_offset.y == 3
            assert pane.show_vertical_scrollbar
            pane.vertical_scrollbar.__class__ = CountedBar
            word = _a_word(many[3].title)
            y, x0, x1 = reword(pane, 3, word, word.swapcase())
            await pilot.pause(0.2)
            seen.append((y, x0, x1, regions[:], drawn[:], scrollbar_lines[0], same_as_full()))
            # (Its spans stay where they were: the lines after it in the option differ too.)
            y, _, _ = reword(pane, 3, word.swapcase(), word + "s")
            await pilot.pause(0.2)
            seen.append(
                (y, 0, text_width, regions[:], drawn[:], scrollbar_lines[0], same_as_full())
            )
            return seen

    for y, x0, x1, refreshed, lines, bar_lines, same in asyncio.run(run()):
        assert len(refreshed) == 1, refreshed  # one repaint
        marked = refreshed[0]
        if x1 < text_width:  # the same length: the cells that differ, on its line
            assert marked == [Region(x0, y - 1, x1 - x0, 1)], marked
        else:  # longer: its line across the text (and any other that differs), no further
            assert Region(0, y - 1, text_width, 1) in marked, marked
            assert all(region.x == 0 and region.right == text_width for region in marked)
        drawn_lines = sorted(y for crop in lines for y in range(crop.y, crop.bottom))
        # Those lines (under the pane's border), no others.
        assert drawn_lines == sorted(region.y + 1 for region in marked), lines
        assert bar_lines == 0  # the scrollbar beside it drew nothing
        assert same  # the terminal shows what a full frame does


def test_a_round_of_the_table_looks_its_size_up_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # A round whose STEPs moved (every row, every 2 s) looked the table's size up for its
    # width, again for its layout's key, and twice for each run of lines it repainted: each a
    # search of the screen's map of widgets (Widget.region) and the CSS gutter (issue 35 item
    # 8).  Once now; the frame is still what a full frame shows.
    from ui_helpers import full_frame, play_into_terminal, steps_moved

    from memtop.ui.widgets.process_table import ProcessTable

    app = MemtopApp(frozen_store(), None, clock=lambda: NOW, host="gpu-box", my_uid=MY_UID)
    terminal = play_into_terminal(app)
    lookups = [0]
    region = Widget.region.fget  # type: ignore[attr-defined]

    def counted_region(self: Widget):  # type: ignore[no-untyped-def]
        lookups[0] += isinstance(self, ProcessTable)
        return region(self)

    async def run() -> tuple[list[int], bool]:
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.2)
            table = app.table
            counts = []
            for _ in range(3):
                moved = steps_moved(table)
                monkeypatch.setattr(Widget, "region", property(counted_region))
                lookups[0] = 0
                table.show(moved, False, True)
                counts.append(lookups[0])
                monkeypatch.undo()
                await pilot.pause(0.1)
            return counts, terminal.cells == full_frame(app).cells

    counts, same = asyncio.run(run())
    assert counts == [1, 1, 1], f"the table's size looked up {counts} times a round"
    assert same


@pytest.mark.parametrize("size", [(80, 24), (120, 36)])
def test_a_table_row_is_laid_out_to_the_tables_width_and_drawn_without_a_cut(
    monkeypatch: pytest.MonkeyPatch, size: tuple[int, int]
) -> None:
    # STEP moves on every row every 2 s: each row drawn was one cell wider than the table (the
    # gap after its last column) and cut to the width, a Strip.crop that was most of the
    # table's drawing (issue 35 item 8).
    from textual.strip import Strip

    app = MemtopApp(frozen_store(), None, clock=lambda: NOW, host="gpu-box", my_uid=MY_UID)

    async def run() -> tuple[list[int], int, int]:
        async with app.run_test(size=size) as pilot:
            await pilot.pause(0.2)
            table = app.table
            width = table.content_region.width
            crops = [0]
            crop = Strip.crop

            def counted(self: Strip, start: int, end: int | None = None) -> Strip:
                crops[0] += 1
                return crop(self, start, end)

            monkeypatch.setattr(Strip, "crop", counted)
            rows = len(table.lines)
            widths = [table.render_line(y).cell_length for y in range(1, rows + 1)]
            monkeypatch.undo()
            return widths, width, crops[0]

    widths, width, crops = asyncio.run(run())
    assert len(widths) >= 3 and set(widths) == {width}
    assert crops == 0, f"{crops} rows cut to the table's width"


def test_the_pane_brings_its_lines_up_to_date_once_a_drawing_not_once_a_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Textual's OptionList brings its lines up to date (new options measured, its virtual size
    # checked) and looks its width up again for every line it draws: most of drawing a line of
    # an option already laid out (issue 35 item 8).  The pane does both once a drawing; its
    # lines are Textual's (the terminal shows what a full frame shows).
    from textual.geometry import Region
    from textual.widgets import OptionList
    from ui_helpers import full_frame, play_into_terminal

    app = MemtopApp(frozen_store(), None, clock=lambda: NOW + 0.5, host="gpu-box", my_uid=MY_UID)
    terminal = play_into_terminal(app)
    updates = [0]
    original = OptionList._update_lines

    def counted(self):  # type: ignore[no-untyped-def]
        updates[0] += 1
        return original(self)

    async def run() -> tuple[int, int, bool, list]:  # type: ignore[type-arg]
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.2)
            pane = app.query_one(SuggestionsPane)
            height = pane.outer_size.height - 2
            monkeypatch.setattr(OptionList, "_update_lines", counted)
            pane._styles_cache.clear()
            strips = pane.render_lines(Region(0, 1, pane.outer_size.width, height))
            drawn = updates[0]
            monkeypatch.setattr(OptionList, "_update_lines", original)
            pane._styles_cache.clear()
            again = pane.render_lines(Region(0, 1, pane.outer_size.width, height))
            pane.refresh()
            await pilot.pause(0.2)
            return drawn, height, terminal.cells == full_frame(app).cells, [strips, again]

    drawn, height, same, (strips, again) = asyncio.run(run())
    assert height >= 10
    assert drawn == 1, f"{drawn} updates of the pane's lines to draw {height} of them"
    assert [strip.text for strip in strips] == [strip.text for strip in again]
    assert same


# --- The GPU cards, the suggestions pane and the round's view-model (w15-cards) ------------


def test_a_renewed_card_looks_neither_its_width_nor_its_style_up_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each slow period every card takes its new figures, and the cards with news every round.
    # A card looked its width up (a walk to the screen's map of widgets) for its layout, again
    # for its lines and again for each region it marked, and its own style (every ancestor's
    # styles walked) each time it drew its line again: a third of a card's round (issue 35
    # item 8).  Now it lays itself out at the width it was drawn at (render_line lays it out
    # again at another), and keeps its style until its CSS changes; the terminal shows what a
    # full frame shows.
    from dataclasses import replace

    from textual.app import App, ComposeResult
    from textual.dom import DOMNode
    from ui_helpers import a_gpu_row, full_frame, play_into_terminal

    from memtop.ui.widgets.gpu_panel import GpuCard

    gib = 1 << 30
    row = a_gpu_row()

    class One(App[None]):
        def compose(self) -> ComposeResult:
            yield GpuCard(row)

    sizes = [0]
    styles = [0]
    size = Widget.size.fget  # type: ignore[attr-defined]
    rich_style = DOMNode.rich_style.fget  # type: ignore[attr-defined]

    def counted_size(self: Widget):  # type: ignore[no-untyped-def]
        sizes[0] += isinstance(self, GpuCard)
        return size(self)

    def counted_style(self: DOMNode):  # type: ignore[no-untyped-def]
        styles[0] += isinstance(self, GpuCard)
        return rich_style(self)

    async def run() -> tuple[list[tuple[int, int]], str, bool]:
        app = One()
        terminal = play_into_terminal(app)
        async with app.run_test(size=(120, 4)) as pilot:
            card = app.query_one(GpuCard)
            await pilot.pause()
            monkeypatch.setattr(Widget, "size", property(counted_size))
            monkeypatch.setattr(DOMNode, "rich_style", property(counted_style))
            counts = []
            for round_ in range(1, 4):  # both lines move: used, allocated, the utilisation
                grown = round_ * gib
                sizes[0] = styles[0] = 0
                card.show(
                    replace(row, used=row.used + grown, allocated=row.allocated + grown),
                    renew=True,
                )
                shown = sizes[0]
                await pilot.pause()
                counts.append((shown, styles[0]))
            monkeypatch.undo()
            drawn = "".join(seg.text for strip in card._strips or [] for seg in strip)
            return counts, drawn, terminal.cells == full_frame(app).cells

    counts, drawn, same = asyncio.run(run())
    assert "43.0 GiB" in drawn  # the third round's used, drawn
    assert same
    assert all(shown == 0 for shown, _ in counts), counts  # (4 a round before)
    assert all(style == 0 for _, style in counts), counts  # its style as it was


def test_suggestions_reworded_together_are_placed_once_and_never_split_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each slow period the suggestions whose figures moved are worded again together.  Each
    # one looked the pane's lines up again (brought up to date twice: where it starts, its
    # height) and its width, and split its old and new prompts into lines to compare them (and
    # the new one again to draw it): most of a reworded suggestion's cost (issue 35 item 8).
    # Now the pane's width is looked up once a round (its lines are up to date: every option
    # is measured), and the lines are compared and drawn as they were worded, never split from
    # the prompt; the terminal shows what a full frame shows.
    from rich.text import Text
    from textual.widgets import OptionList
    from ui_helpers import full_frame, play_into_terminal

    app = MemtopApp(frozen_store(), None, clock=lambda: NOW + 0.5, host="gpu-box", my_uid=MY_UID)
    terminal = play_into_terminal(app)
    updates = [0]
    splits = [0]
    widths = [0]
    update_lines = OptionList._update_lines
    split = Text.split
    region = Widget.scrollable_content_region.fget  # type: ignore[attr-defined]

    def counted_update(self):  # type: ignore[no-untyped-def]
        updates[0] += 1
        return update_lines(self)

    def counted_split(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        splits[0] += 1
        return split(self, *args, **kwargs)

    def counted_region(self):  # type: ignore[no-untyped-def]
        widths[0] += isinstance(self, SuggestionsPane)
        return region(self)

    async def run() -> tuple[int, int, int, int, list[str], str, bool]:
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.2)
            pane = app.query_one(SuggestionsPane)
            items = pane.items
            assert len(items) >= 3, items
            words = [_a_word(item.title) for item in items]
            reworded = tuple(
                dataclasses.replace(item, title=item.title.replace(word, word.swapcase(), 1))
                for item, word in zip(items, words, strict=True)
            )
            monkeypatch.setattr(OptionList, "_update_lines", counted_update)
            monkeypatch.setattr(Text, "split", counted_split)
            monkeypatch.setattr(Widget, "scrollable_content_region", property(counted_region))
            pane.show(reworded, False, True)
            shown = (updates[0], splits[0], widths[0])
            await pilot.pause(0.2)
            drawn_splits = splits[0]
            monkeypatch.undo()
            return (
                *shown,
                drawn_splits,
                [word.swapcase() for word in words],
                screen_text(app.export_screenshot()),
                terminal.cells == full_frame(app).cells,
            )

    updates_, splits_, widths_, drawn_splits, words, text, same = asyncio.run(run())
    assert all(word in text for word in words), words  # every one reworded, drawn
    assert same
    # 5 reworded: their lines brought up to date 10 times before, the width looked up 26 times
    # (now show's own and once for them all), their prompts split 15 times
    assert updates_ == 0, f"the pane's lines brought up to date {updates_} times"
    assert widths_ <= 2, f"the pane's width looked up {widths_} times"
    assert splits_ == drawn_splits == 0, f"{splits_} splits, {drawn_splits} once drawn"


def test_a_cards_line_is_made_from_its_pieces_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every card is laid out again together each slow period, and the cards with news every
    # round.  Its line was ~19 `Text.append`s (each piece checked, cleaned of control codes,
    # measured, its spans made through a generator): a quarter of laying a card out.  Now its
    # pieces are gathered and made one Text (LineText), but for the memory bar's runs; the
    # same characters and spans, the bold head the line's own style.
    from rich.text import Text
    from ui_helpers import a_gpu_row

    from memtop.ui.view import TrendLine
    from memtop.ui.widgets.gpu_panel import GpuCard

    gib = 1 << 30
    row = a_gpu_row(TrendLine(tuple(40.0 * gib + i for i in range(200)), 80 * gib))
    card = GpuCard(row, dense=True)
    appends = [0]
    append = Text.append

    def counted(self: Text, *args, **kwargs):  # type: ignore[no-untyped-def]
        appends[0] += 1
        return append(self, *args, **kwargs)

    monkeypatch.setattr(Text, "append", counted)
    line = card._first_line(120, compact=False)
    monkeypatch.undo()
    bar_runs = 5  # allocated, cached, the peak's mark, other, free
    assert appends[0] <= bar_runs + 1, f"{appends[0]} appends"  # (19 before)
    assert line.plain.startswith("GPU 0  H100 ▕") and " frag 0.05 " in line.plain
    assert line.style == "bold" and line.plain.endswith(" steady")
    assert [(s.start, s.end, s.style) for s in line.spans][:2] == [
        (12, 13, "bright_black"),
        (13, 28, "green"),
    ]


def test_a_reworded_suggestion_draws_again_only_its_lines_that_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A suggestion's figure moved ("full in ~49 min" → "~48 min", on its title line): all its
    # lines were made into strips again (each segment's style with its place's meta), where
    # its evidence and its fix read as before (issue 35 item 8).  Now the lines that read as
    # before keep their strips; the terminal shows what a full frame shows.
    from ui_helpers import full_frame, play_into_terminal

    from memtop.ui.widgets import suggestions

    app = MemtopApp(frozen_store(), None, clock=lambda: NOW + 0.5, host="gpu-box", my_uid=MY_UID)
    terminal = play_into_terminal(app)
    made: list[int] = []
    option_strip = suggestions._option_strip

    def counted(strip, length, y, option):  # type: ignore[no-untyped-def]
        made.append(y)
        return option_strip(strip, length, y, option)

    async def run() -> tuple[int, list[int], str, bool]:
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.2)
            pane = app.query_one(SuggestionsPane)
            prompt = pane._prompts[0].copy()
            assert "full in ~49 min" in prompt.plain, prompt.plain
            prompt.plain = prompt.plain.replace("~49 min", "~48 min")
            pane._prompts[0] = prompt
            monkeypatch.setattr(suggestions, "_option_strip", counted)
            pane.replace_option_prompt_at_index(0, prompt)
            await pilot.pause(0.2)
            monkeypatch.undo()
            return (
                prompt.plain.count("\n") + 1,
                made,
                screen_text(app.export_screenshot()),
                terminal.cells == full_frame(app).cells,
            )

    lines, made_again, text, same = asyncio.run(run())
    assert lines >= 3 and "full in ~48 min" in text
    assert same
    assert made_again == [0], f"lines {made_again} of the option's {lines} made again"


# ---------------------------------------------------------------- the process table's rounds
# (issue 35 item 8: the table's `show` and drawing, a fifth of the dashboard's work in `mixed`)


def _fits_counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many cells the process table fits to their columns (each cell of a row laid out)."""
    from memtop.ui.widgets import process_table

    count = [0]
    fit = process_table._fit

    def counted(text: str, width: int, right: bool) -> str:
        count[0] += 1
        return fit(text, width, right)

    monkeypatch.setattr(process_table, "_fit", counted)
    return count


def _laid_out_anew(table):  # type: ignore[no-untyped-def]
    """Each of the table's lines as a layout from scratch draws it (a row: `_row_line`)."""
    from rich.text import Text

    _, columns, widths = table._lay_out(table.content_region.width)
    return [
        drawn.plain if isinstance(drawn, Text) else drawn
        for drawn in (
            line.text() if not hasattr(line, "pid") else table._row_line(line, columns, widths, 1)
            for line in table.lines
        )
    ]


def _shown(table):  # type: ignore[no-untyped-def]
    from rich.text import Text

    return [drawn.plain if isinstance(drawn, Text) else drawn for drawn in table._drawn]


def test_a_round_where_only_steps_moved_lays_out_only_the_step_cells(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every row's STEP moves every STEP_S, most other figures are held to their slow period:
    # each row was laid out anew every round, thirteen cells fit to their columns a row (3.5 %
    # of the dashboard's samples in `mixed`).  A row whose other cells show what they showed
    # keeps its line, its STEP set into it: one cell a row, and the same lines.
    from ui_helpers import steps_moved

    app = MemtopApp(frozen_store(), None, clock=lambda: NOW, host="gpu-box", my_uid=MY_UID)

    async def run() -> tuple[int, int, list, list]:  # type: ignore[type-arg]
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.2)
            table = app.table
            # (No await from here on: the dashboard's own round would show its rows again.)
            table.show(steps_moved(table), False, True)
            fits = _fits_counted(monkeypatch)
            table.show(steps_moved(table), False, True)
            counted = fits[0]
            monkeypatch.undo()
            return counted, len(table.rows), _shown(table), _laid_out_anew(table)

    fits, rows, shown, anew = asyncio.run(run())
    assert rows >= 4
    assert fits == rows, f"{fits} cells laid out for {rows} rows whose STEP alone moved"
    assert shown == anew


def test_a_rows_line_follows_every_field_it_shows_and_no_other() -> None:
    # The table keeps each row's line by the fields its cells read (LINE_FIELDS, TIME's
    # minute) and sets its STEP into it: changing any field of a row, one at a time, draws the
    # line a layout from scratch draws (a field a cell reads and LINE_FIELDS left out would
    # leave last round's line on screen).
    import dataclasses

    from memtop.engine.observation import ProcessRow, ProcessState

    def other(name: str, value: object) -> object:
        if name == "state":
            return ProcessState.EXITED if value != ProcessState.EXITED else ProcessState.HUNG
        if name in ("workload", "agent", "agent_device", "info"):
            return None
        if isinstance(value, bool):
            return not value
        if isinstance(value, int | float):
            return value * 3 + 3600
        if isinstance(value, str):
            return "x" + value if value else "+9.0M/step"
        return 7  # None: a figure now known

    app = MemtopApp(frozen_store(), None, clock=lambda: NOW, host="gpu-box", my_uid=MY_UID)

    async def run() -> list[tuple[str, bool, bool]]:
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.2)
            table = app.table
            base = table.source
            seen = []
            for field in dataclasses.fields(ProcessRow):
                index = next(i for i, row in enumerate(base) if row.step is not None)
                row = base[index]
                changed = dataclasses.replace(
                    row, **{field.name: other(field.name, getattr(row, field.name))}
                )
                rows = (*base[:index], changed, *base[index + 1 :])
                table.show(base, False, True)
                before = _shown(table)
                table.show(rows, False, True)
                seen.append(
                    (field.name, _shown(table) == _laid_out_anew(table), _shown(table) != before)
                )
            return seen

    seen = asyncio.run(run())
    assert len(seen) >= 30
    assert all(same for _, same, _ in seen), [name for name, same, _ in seen if not same]
    moved = {name for name, _, differs in seen if differs}
    assert {"used", "step", "trend", "state", "command", "run_seconds"} <= moved, moved


def _cells(strips):  # type: ignore[no-untyped-def]
    """Each line's cells: its character and its style as drawn."""
    return [[(ch, seg.style) for seg in strip for ch in seg.text] for strip in strips]


@pytest.mark.parametrize("size", [(80, 24), (120, 36)])
def test_a_table_line_is_framed_as_textual_frames_it_without_its_per_line_work(
    monkeypatch: pytest.MonkeyPatch, size: tuple[int, int]
) -> None:
    # Textual works a widget's frame (border edges and colours, padding, tint, opacity) out
    # again for every line it draws: ~25 us of each ~35 us table row, a row per STEP that
    # moved, every row every 2 s (issue 35 item 8).  The table frames its rows as Textual
    # framed a stand-in line, learnt once: the same cells on every line of the table (its
    # border, its header, its rows, the cursor's), focused or not, in the full layout and the
    # compact one (80x24: no side borders, no padding); a round's rows drawn without Textual's
    # per-line frame, and the terminal shows what a full frame shows.
    from textual._styles_cache import StylesCache
    from textual.geometry import Region
    from ui_helpers import full_frame, play_into_terminal, steps_moved

    app = MemtopApp(frozen_store(), None, clock=lambda: NOW, host="gpu-box", my_uid=MY_UID)
    terminal = play_into_terminal(app)
    framed = [0]
    render_line = StylesCache.render_line

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        table = app.table
        y, size, content_line = args[1], args[2], args[7]
        gutter = table.styles.gutter
        if (
            getattr(content_line, "__self__", None) is table  # (not the stand-in line)
            and gutter.top <= y < size.height - gutter.bottom  # a content line, not a border
        ):
            framed[0] += 1
        return render_line(self, *args, **kwargs)

    async def run() -> list[tuple[list, list]]:  # type: ignore[type-arg]
        async with app.run_test(size=size) as pilot:
            await pilot.pause(0.2)
            table = app.table
            app.refresh_view = lambda *a, **k: None  # type: ignore[method-assign]  # ours only
            whole = Region(0, 0, table.outer_size.width, table.outer_size.height)
            compared = []
            for focused in (True, False):
                if not focused:
                    app.set_focus(None)
                    await pilot.pause(0.2)
                table._styles_cache.clear()
                ours = table.render_lines(whole)
                textuals = StylesCache()
                table._styles_cache, kept = textuals, table._styles_cache
                try:
                    compared.append((_cells(ours), _cells(table.render_lines(whole))))
                finally:
                    table._styles_cache = kept
            monkeypatch.setattr(StylesCache, "render_line", counted)
            table.show(steps_moved(table), False, True)
            await pilot.pause(0.2)
            monkeypatch.undo()
            compared.append(([terminal.cells], [full_frame(app).cells]))
            return compared

    compared = asyncio.run(run())
    assert len(compared[0][0]) >= 6  # every line of the table
    for ours, textuals in compared:
        assert ours == textuals
    assert compared[0][0] != compared[1][0]  # (focus shows: the border's colour, the cursor's)
    assert framed[0] == 0, f"Textual framed {framed[0]} of the round's lines itself"


def test_a_round_looks_up_no_component_style_and_blur_still_shows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Textual keeps a widget's component styles (the header's, the cursor's) until its next
    # refresh(), which the table does every round: the cursor's row looked its style up
    # through the CSS again each time it was drawn (~35 us, issue 35 item 8).  The table keeps
    # them until its CSS changes: a blurred table draws its cursor in the blurred style, as a
    # look-up afresh does.
    from textual.dom import DOMNode
    from ui_helpers import steps_moved

    from memtop.ui.widgets.process_table import ProcessTable

    app = MemtopApp(frozen_store(), None, clock=lambda: NOW, host="gpu-box", my_uid=MY_UID)
    counts = {"looked up": 0, "restyled": 0}  # the table's, this round
    get_component_styles = DOMNode.get_component_styles
    notify_style_update = ProcessTable.notify_style_update

    def looked_up(self, *names):  # type: ignore[no-untyped-def]
        if self is app.table:
            counts["looked up"] += 1
        return get_component_styles(self, *names)

    def restyled(self):  # type: ignore[no-untyped-def]
        counts["restyled"] += 1  # (its CSS applied again: a look-up is due)
        return notify_style_update(self)

    async def run() -> tuple[list, list, list, list]:  # type: ignore[type-arg]
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.2)
            table = app.table
            app.refresh_view = lambda *a, **k: None  # type: ignore[method-assign]  # ours only
            cursor_y = table._line_of(table.cursor_row) - table._top + 1
            assert table.has_focus
            focused = _cells([table.render_line(cursor_y)])
            monkeypatch.setattr(DOMNode, "get_component_styles", looked_up)
            monkeypatch.setattr(ProcessTable, "notify_style_update", restyled)
            rounds = []
            for _ in range(3):
                counts.update({"looked up": 0, "restyled": 0})
                table.show(steps_moved(table), False, True)
                await pilot.pause(0.1)
                rounds.append((counts["looked up"], counts["restyled"]))
            monkeypatch.undo()
            app.set_focus(None)
            await pilot.pause(0.2)
            blurred = _cells([table.render_line(cursor_y)])
            getattr(table, "_component_style_kept", {}).clear()  # (the old table: none)
            table._rich_style_cache.clear()
            table._base_style = None
            return rounds, focused, blurred, _cells([table.render_line(cursor_y)])

    rounds, focused, blurred, afresh = asyncio.run(run())
    quiet = [looked for looked, restyled in rounds if not restyled]
    assert quiet, rounds  # (a round where the table's CSS was not applied again)
    assert not any(quiet), f"component styles looked up in rounds {rounds} (looked up, restyled)"
    assert blurred != focused
    assert blurred == afresh


def test_a_held_row_is_the_row_replace_makes_without_replace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Between slow periods the table shows each row's STEP and slow figures as it showed them
    # last: most rows are held every round (a STEP moves every round, a sawtooth's allocated
    # bytes too).  dataclasses.replace made each held copy by keyword, ~9 us a row (issue 35
    # item 8); the table makes it from the row's fields in order: the same row.
    import dataclasses

    from memtop.ui.widgets import process_table
    from memtop.ui.widgets.process_table import SLOW_FIELDS, STEP_FIELDS

    app = MemtopApp(frozen_store(), None, clock=lambda: NOW, host="gpu-box", my_uid=MY_UID)
    replaced = [0]
    replace = dataclasses.replace

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        replaced[0] += 1
        return replace(*args, **kwargs)

    async def run() -> tuple[int, list, list]:  # type: ignore[type-arg]
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.2)
            table = app.table
            shown = table.source
            moved = tuple(
                replace(
                    row,
                    step=None if row.step is None else row.step + 5,
                    allocated=None if row.allocated is None else row.allocated * 2 + 1,
                    rss=7,
                )
                for row in shown
            )
            monkeypatch.setattr(process_table, "replace", counted)
            held = [
                process_table._hold(row, old, SLOW_FIELDS + STEP_FIELDS)
                for row, old in zip(moved, shown, strict=True)
            ]
            monkeypatch.undo()
            expected = [
                replace(row, **{name: getattr(old, name) for name in SLOW_FIELDS + STEP_FIELDS})
                for row, old in zip(moved, shown, strict=True)
            ]
            return replaced[0], held, expected

    replaced_rows, held, expected = asyncio.run(run())
    assert len(held) >= 4
    assert held == expected
    assert all(h.agent is e.agent and h.info is e.info for h, e in zip(held, expected, strict=True))
    assert replaced_rows == 0, f"{replaced_rows} rows held through dataclasses.replace"
