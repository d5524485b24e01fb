"""Issue 21: what the dashboard says is true at every moment (frozen data, the real app under
Textual's pilot): sort arrows, the suggestions' focus, read-only mode, filters, wording."""

from __future__ import annotations

from test_ui_frozen import frozen_app
from test_ui_nvitop import drive, pids
from ui_helpers import screen_text

from memtop.ui.app import MemtopApp
from memtop.ui.widgets.process_table import ProcessTable
from memtop.ui.widgets.suggestions import SuggestionsPane


def test_sort_arrow_says_the_order_not_the_inversion() -> None:
    # PID sorts ascending by nature: it showed "PID▼" beside "USED▼" meaning descending.
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        table = app.query_one(ProcessTable)
        await pilot.press("greater_than_sign")
        assert table.sort_key == "pid" and pids(app) == sorted(pids(app))
        await pilot.pause()
        screen = screen_text(app.export_screenshot())
        assert "PID▲" in screen and "sort pid ▲" in screen
        await pilot.press("I")
        await pilot.pause()
        screen = screen_text(app.export_screenshot())
        assert pids(app) == sorted(pids(app), reverse=True)
        assert "PID▼" in screen and "sort pid ▼" in screen

    drive(frozen_app(), body)


def test_tab_to_suggestions_highlights_the_first_and_enter_opens_it() -> None:
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        pane = app.query_one(SuggestionsPane)
        await pilot.press("tab")
        assert app.focused is pane
        assert pane.highlighted == 0 and pane.selected() is pane.items[0]
        first = pane.items[0]
        await pilot.press("enter")
        await pilot.pause(0.2)
        assert getattr(app.screen, "shows_process", False)
        assert app.screen.row.pid == first.pid  # type: ignore[attr-defined]

    drive(frozen_app(), body)
