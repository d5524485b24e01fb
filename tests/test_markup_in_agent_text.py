"""Markup in an agent's words is shown as words (issue 36, item 2).

An agent's error message (`try again [/x] later` on `c`), an OOM report's `fix` copied with
`y`, a fleet host's name (`memtop export --hostname 'node[/x]'`) ended root's dashboard with
MarkupError: notifications and panes parsed them as Rich/Textual markup.  Here a real agent
(tests/hostile_agent.py `markup`) puts markup in every string it sends, and a fleet host is
named with markup; the real dashboard under Textual's pilot walks every notification, dialog
and pane, and must still be running with the text shown literally.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hostile_agent import MARKUP, MARKUP_SETTING
from ui_helpers import notifications, screen_text, wait_for

from memtop.engine.sampler import Sampler
from memtop.engine.store import Store
from memtop.sources.agents import AgentPool
from memtop.sources.devices import DefaultDeviceSource

pytestmark = pytest.mark.slow

HOSTILE = str(Path(__file__).with_name("hostile_agent.py"))


def alive(app: Any) -> bool:
    """Running, and no error waiting to end it (a MarkupError while drawing ends the app)."""
    return bool(app.is_running and app._exception is None and not app._exit_renderables)


@pytest.fixture
def markup_agent(socket_dir: Path) -> Iterator[int]:
    process = subprocess.Popen(
        [sys.executable, HOSTILE, "markup", str(socket_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        yield process.pid
    finally:
        process.kill()
        process.wait()


def test_every_notification_dialog_and_pane_shows_an_agents_markup_as_text(
    markup_agent: int, socket_dir: Path
) -> None:
    from memtop.ui.app import MemtopApp
    from memtop.ui.widgets.process_table import ProcessTable

    store = Store()
    sampler = Sampler(
        store, DefaultDeviceSource(socket_dir, simulated_only=True), AgentPool(socket_dir), 0.5
    )
    sampler.start()
    app = MemtopApp(store, sampler, interval=0.5)
    seen: list[str] = []  # what each screen showed, for the failure message
    copied: list[str] = []
    app.copy_to_clipboard = copied.append  # type: ignore[method-assign]

    def shown() -> str:
        """The screen's text and the toasts' (rendered here as the screen renders them)."""
        from textual.widgets._toast import Toast

        toasts = [str(t.render()) for t in app.screen.query(Toast)]
        seen.append("\n".join([screen_text(app.export_screenshot()), *toasts]))
        return seen[-1]

    async def main() -> None:
        async with app.run_test(size=(160, 48), notifications=True) as pilot:
            table = app.query_one(ProcessTable)

            def the_agent_is_read() -> bool:
                return any(r.pid == markup_agent and r.state == "agent" for r in app_rows())

            def app_rows() -> list:
                return list(table.rows_by_key.values())

            await wait_for(pilot, the_agent_is_read)
            key = next(k for k, r in table.rows_by_key.items() if r.pid == markup_agent)
            table.move_cursor(row=table.get_row_index(key))
            table.focus()
            await pilot.pause(0.6)
            assert MARKUP in shown()  # the argv in the table, the OOM in the suggestions
            # Each action fails with the agent's markup as its error message.
            for action in ("c", "r", "s"):
                app.clear_notifications()
                await pilot.press(action)
                await wait_for(
                    pilot, lambda: any(MARKUP in n for n in notifications(app)), timeout=10
                )
                await pilot.pause(0.3)
                assert alive(app), action
                assert f"failed: {MARKUP}" in shown(), action
            # The stacks dialog, then the agent's refusal.
            app.clear_notifications()
            await pilot.press("w")
            await pilot.pause(0.3)
            await pilot.press("y")
            await wait_for(pilot, lambda: any(MARKUP in n for n in notifications(app)))
            await pilot.pause(0.3)
            assert alive(app) and f"failed: {MARKUP}" in shown()
            # y: the OOM report's fix, the agent's own words.
            app.clear_notifications()
            await pilot.press("y")
            await wait_for(pilot, lambda: bool(copied))
            await pilot.pause(0.3)
            assert alive(app) and "Copied the agent's fix (its words, not memtop's): " in shown()
            assert MARKUP_SETTING in shown().replace("\n", "")
            # The kill dialog (it shows the command line /proc has), cancelled.
            await pilot.press("k")
            await pilot.pause(0.5)
            assert alive(app) and f"Signal pid {markup_agent}?" in shown()
            await pilot.press("n")
            await pilot.pause(0.2)
            # The detail screen: the breakdown, the facts, the suggestions, the OOM's stack.
            await pilot.press("enter")
            await pilot.pause(1.0)
            detail = shown()
            assert alive(app) and MARKUP in detail
            assert "[bold].py:7" in detail  # the sites pane (a file named with markup)
            await pilot.press("escape")
            await pilot.press("question_mark")
            await pilot.pause(0.3)
            assert alive(app)
            await pilot.press("escape")
            await pilot.pause(0.3)
            assert alive(app)

    try:
        asyncio.run(main())
    finally:
        sampler.stop()
    assert copied == [MARKUP_SETTING]


def test_a_fleet_host_named_with_markup_is_shown_by_that_name() -> None:
    from helpers.observations import frozen_observation
    from test_fleet import _as_prometheus_has_it, _Fixed

    from memtop.engine.fleet import FleetSampler
    from memtop.export.metrics import render
    from memtop.export.text import exposition
    from memtop.sources.prometheus import hosts_of
    from memtop.ui.app import MemtopApp

    name = "node[/x]"
    text = exposition(render(frozen_observation(), host=name)).decode()
    other = exposition(render(frozen_observation(), host="node[@click=app.quit]b")).decode()
    hosts = hosts_of(_as_prometheus_has_it(text) + _as_prometheus_has_it(other, "b:9482"))
    sampler = FleetSampler(_Fixed(hosts), interval=60.0)  # type: ignore[arg-type]
    sampler.sample_once()
    app = MemtopApp(
        sampler.store, sampler, interval=60.0, host="fleet", observer=sampler.observer()
    )  # type: ignore[arg-type]
    shown: list[str] = []

    async def main() -> None:
        async with app.run_test(size=(160, 48), notifications=True) as pilot:
            await wait_for(pilot, lambda: app.dashboard is not None and app.dashboard.processes)
            await pilot.pause(0.3)
            app.table.focus()
            for row in range(len(app.table.rows)):  # each process of both hosts
                app.table.move_cursor(row=row)
                # (pilot.press waits, after each key, until the app has handled it and idles.)
                await pilot.press("c", "k", "n", "a", "n", "w", "n", "y")
                await pilot.pause(0.2)
                assert alive(app), (row, notifications(app))
                shown.append(screen_text(app.export_screenshot()))
                # The row's toasts are on the screen just taken; the next row's are its own
                # (each key's toast stays 3-10 s: six rows' of them re-laid out at every key
                # were most of this test's CPU).
                app.clear_notifications()
            # A filter typed with markup in it: shown in the table's border as typed.
            await pilot.press("slash", "left_square_bracket", "slash", "x")
            await pilot.press("right_square_bracket", "enter")
            await pilot.pause(0.3)
            assert alive(app) and "filter “[/x]”" in screen_text(app.export_screenshot())
            await pilot.press("slash", *["backspace"] * 4, "enter")
            await pilot.pause(0.3)
            await pilot.press("enter")
            await pilot.pause(0.5)
            assert alive(app)
            shown.append(screen_text(app.export_screenshot()))
            await pilot.press("escape")
            await pilot.pause(0.3)
            assert alive(app)
            shown.append(screen_text(app.export_screenshot()))

    try:
        asyncio.run(main())
    finally:
        sampler.stop()
    assert name in "\n".join(shown), shown
