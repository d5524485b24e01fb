"""The process table and the suggestions pane are laid out for the width they are drawn at, in
the frame that first draws them there: the dashboard builds its view before Textual lays the
widgets out (at the start, and on a resized terminal), so what a widget laid out when it was given
its figures was for a width it no longer has."""

from __future__ import annotations

import asyncio

from test_start_path import _painted
from textual.geometry import Region
from ui_frozen import MY_UID, NOW, frozen_store

from memtop.ui.app import MemtopApp


def test_the_first_frame_after_a_resize_is_the_resized_dashboard() -> None:
    # Narrower: the table drops its TIME column and gives COMMAND the rest; the suggestions are
    # cut at the pane's new width.  The first frame at the new size showed the rows and the
    # suggestions laid out for the old one, cut at the border, until the table's own Resize (a
    # frame later) and the next round (a second later) laid them out again.
    app = MemtopApp(frozen_store(), None, clock=lambda: NOW + 0.5, host="gpu-box", my_uid=MY_UID)
    size = (110, 40)
    frames: list[tuple[bool, str]] = []  # (whether it paints the whole screen, its text)

    async def run() -> None:
        async with app.run_test(size=(140, 40)) as pilot:
            await pilot.pause(0.2)
            display = app._display

            def kept(screen, update):  # type: ignore[no-untyped-def]
                if update is not None and hasattr(update, "render_segments"):
                    whole = getattr(update, "region", None) == Region(0, 0, *size)
                    frames.append((whole, update.render_segments(app.console)))
                display(screen, update)

            app._display = kept  # type: ignore[method-assign]
            await pilot.resize_terminal(*size)
            await pilot.pause(0.3)

    asyncio.run(run())
    # The resize's frame: the first that paints the whole screen at the new size.  What Textual
    # still had to draw for the old size (the footer's keys, filled in a moment after the
    # start: slower under load than the pause above) may come before it, and paints a row.
    whole = [at for at, (is_whole, _) in enumerate(frames) if is_whole]
    assert whole, [text[:80] for _, text in frames]
    first = _painted(frames[whole[0]][1], size)
    settled = first
    for _, frame in frames[whole[0] + 1 :]:
        settled = _painted_over(settled, frame, size)
    table = [line for line in settled if " PID " in line]
    assert table and " TIME " not in table[0] and " COMMAND" in table[0], settled
    # Every line of the table and of the suggestions as it stands once everything has settled
    # (the footer's keys are Textual's own, filled in a moment later: not compared).
    assert first[:-1] == settled[:-1], "\n".join(
        f"{a}\n{b}" for a, b in zip(first, settled, strict=True) if a != b
    )


def _painted_over(screen: list[str], frame: str, size: tuple[int, int]) -> list[str]:
    """`screen` with `frame` painted over it (a frame writes only the cells it changes)."""
    painted = _painted(frame, size)
    marks = _painted(frame.replace(" ", "\x00"), size)  # (what the frame wrote, spaces too)
    return [
        "".join(new if mark != " " else old for old, new, mark in zip(o, n, m, strict=True))
        for o, n, m in zip(screen, painted, marks, strict=True)
    ]
