"""What a round costs the dashboard when little changed (issue 35, item 8): the work a round
does is the work its news needs, not a re-layout or redraw of everything."""

from __future__ import annotations

import asyncio

import pytest
from textual.widget import Widget
from ui_frozen import MY_UID, NOW, frozen_store
from ui_helpers import screen_text, wait_for

from memtop.ui import app as app_module
from memtop.ui.app import MemtopApp


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
