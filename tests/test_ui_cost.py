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
            many = tuple(
                dataclasses.replace(item, key=f"{item.key}#{copy}")
                for copy in range(6)
                for item in items
            )
            pane.show(many, False, True)
            await pilot.pause(0.2)
            return after_fewer, after_more, layouts[0], one, every, pane.show_vertical_scrollbar

    fewer, more, overflow, one, every, scrollbar = asyncio.run(run())
    title = app.dashboard.suggestions[1].title  # type: ignore[union-attr]
    assert title[:40] not in one and title[:40] in every  # shown at once, both ways
    assert (fewer, more) == (0, 0), "the whole screen was laid out again for the pane's lines"
    assert scrollbar and overflow >= 1  # its scrollbar's place is the layout's


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
