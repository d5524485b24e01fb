"""Helpers for driving the dashboard with Textual's pilot."""

from __future__ import annotations

import html
import re
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from textual._compositor import CompositorUpdate
from textual.app import App
from textual.pilot import Pilot

from memtop.engine.sampler import Sampler
from memtop.engine.store import Store
from memtop.sources.agents import AgentPool
from memtop.sources.devices import DefaultDeviceSource
from memtop.ui.app import MemtopApp
from memtop.ui.cell_diff import CellDiff
from memtop.ui.view import GpuRow, ProcessRow, Trend, TrendLine
from memtop.ui.widgets.process_table import ProcessTable

LIVE_INTERVAL = 0.25  # a live test's sampler round (and its dashboard's, unless told)


def live_app(
    socket_dir: Path, app_interval: float = LIVE_INTERVAL, **app_options: Any
) -> tuple[MemtopApp, Sampler]:
    """The dashboard on the agents (and simulated GPUs) under `socket_dir`, its sampler
    started: the caller stops it (`sampler.stop()`) when the app is done."""
    store = Store()
    sampler = Sampler(
        store,
        DefaultDeviceSource(socket_dir, simulated_only=True),
        AgentPool(socket_dir),
        interval=LIVE_INTERVAL,
    )
    sampler.start()
    app = MemtopApp(store, sampler, interval=app_interval, **app_options)
    _keep_notified(app)
    return app, sampler


def _keep_notified(app: MemtopApp) -> None:
    """Every notification a live test's app makes, kept on it (`notified`: when, and the words
    as `notifications` gives them).  A notification lives ~5 s on screen; on a loaded box the
    key press that caused it can take longer than that to return (pilot.press waits for the
    app to idle), and a wait for it that starts then never sees it: `-n 2` over the CPU
    trainer, containers, snapshot-path and live modules, "sent SIGKILL" was made ~5.7 s
    before the terminate test's wait for it began (load ~35)."""
    said: list[tuple[float, str]] = []
    app.notified = said  # type: ignore[attr-defined]
    notify = app.notify

    def kept(message: str, *, title: str = "", **kwargs: Any) -> None:
        said.append((time.monotonic(), f"{title}: {message}"))
        notify(message, title=title, **kwargs)

    app.notify = kept  # type: ignore[method-assign]


# Rich's SVG export places each run of text at x = column × 0.61 × its 20 px font.
CHAR_WIDTH = 12.2


async def wait_for(pilot: Pilot, predicate: Callable[[], object], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            # What the app said meanwhile: a refusal or a failure ("cleanup in pid N failed:
            # ...") is what a wait for a notification that never came needs to show.
            app = pilot.app
            said = notifications(app) if isinstance(app, MemtopApp) else []
            raise AssertionError(
                f"timed out waiting for {getattr(predicate, '__name__', '')} at "
                f"{time.monotonic():.1f}; notifications: {said}"
            )
        await pilot.pause(0.05)


def notifications(app: MemtopApp) -> list[str]:
    """What the app notified: every notification a live_app made (expired ones too, with
    when), else those on screen now."""
    kept = getattr(app, "notified", None)
    if kept is not None:
        return [words for _, words in kept]
    return [f"{n.title}: {n.message}" for n in app._notifications]


def screen_text(svg: str) -> str:
    """The characters of an SVG screenshot, one line per terminal row (styles dropped)."""
    rows: dict[float, list[tuple[float, str]]] = {}
    for match in re.finditer(
        r'<text class="[^"]*" x="([\d.]+)" y="([\d.]+)"[^>]*>(.*?)</text>', svg
    ):
        x, y, content = float(match.group(1)), float(match.group(2)), match.group(3)
        rows.setdefault(y, []).append((x, html.unescape(content).replace("\xa0", " ")))
    lines = []
    for y in sorted(rows):
        line = ""
        for x, text in sorted(rows[y]):
            column = round(x / CHAR_WIDTH)
            line = line.ljust(column) + text
        lines.append(line.rstrip())
    return "\n".join(lines)


def play_into_terminal(app: App[object]) -> CellDiff:
    """A terminal model (memtop.ui.cell_diff) that every update of `app` is played into as a
    real terminal would receive it (a headless app writes nothing)."""
    terminal = CellDiff()

    def display(screen: object, renderable: object) -> None:
        if isinstance(renderable, CompositorUpdate):
            terminal.feed(renderable.render_segments(app.console))

    app._display = display  # type: ignore[method-assign,assignment]
    return terminal


def full_frame(app: App[object]) -> CellDiff:
    """What the terminal shows after one full frame of `app`'s screen as it is now."""
    terminal = CellDiff()
    update = app.screen._compositor.render_update(full=True)
    assert isinstance(update, CompositorUpdate)
    terminal.feed(update.render_segments(app.console))
    return terminal


def steps_moved(table: ProcessTable) -> tuple[ProcessRow, ...]:
    """The table's rows as a round one step later shows them: every STEP that has one, + 1."""
    return tuple(
        replace(row, step=row.step + 1) if row.step is not None else row for row in table.source
    )


def a_gpu_row(trend: TrendLine | None = None) -> GpuRow:
    """An H100 half used by one trainer, steady: a GPU card's row for the tests that draw one
    (`trend`: its trend line, by default ten flat points)."""
    gib = 1 << 30
    return GpuRow(
        index=0,
        uuid="GPU-0",
        name="H100",
        total=80 * gib,
        used=40 * gib,
        allocated=30 * gib,
        reserved=38 * gib,
        peak=35 * gib,
        other=2 * gib,
        agents=1,
        processes=1,
        fragmentation=0.05,
        trend=Trend(trend or TrendLine((40.0 * gib,) * 10), "steady", 1),
        error=None,
    )
