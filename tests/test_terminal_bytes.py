"""What the dashboard writes to the terminal each second (issue 35 item 8: bytes ≤ nvitop's).

Measured with bench/tui_cost.py --record and bench/tty_where.py on the `mixed` demo (11
agents on 8 GPUs): the table's STEP column was a third of the bytes, a rank's held allocated
bytes renewed with its GPU's news a fifth (tests/test_renewal.py), and each frame's first
style began with a reset the terminal did not need."""

from __future__ import annotations

import asyncio
import re

import pytest
from ui_frozen import MY_UID, NOW, frozen_store
from ui_helpers import full_frame, play_into_terminal, steps_moved

from memtop.ui.cell_diff import CellDiff
from memtop.ui.renewal import NOTHING

SGR = re.compile(r"\x1b\[[0-9;]*m")  # a style (select graphic rendition)


def test_a_step_that_moved_within_its_period_writes_nothing_then_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every row's step moves every round; it is shown anew every STEP_S (2 s, nvitop's
    # refresh), so a round inside the period writes nothing for it, and the next period's
    # first round writes the new steps: a cursor move and a digit or two per row.
    from memtop.ui.app import MemtopApp
    from memtop.ui.widgets import process_table

    period = [7]
    monkeypatch.setattr(process_table, "slow_tick", lambda period_s=0.0: period[0])
    app = MemtopApp(frozen_store(), None, clock=lambda: NOW, host="gpu-box", my_uid=MY_UID)
    terminal = play_into_terminal(app)
    sent: list[str] = []

    async def run() -> tuple[list[str], list[str], tuple[int | None, ...], CellDiff]:
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.3)
            table = app.table
            feed = terminal.feed

            def keep(data: str) -> None:
                sent.append(data)
                feed(data)

            terminal.feed = keep  # type: ignore[method-assign]
            for _ in range(20):  # settled first (the footer's bindings can still be drawing)
                sent.clear()
                await pilot.pause(0.2)
                if not sent:
                    break
            shown = tuple(row.step for row in table.rows)
            stepped = steps_moved(table)
            sent.clear()
            table.show(stepped, False, NOTHING)  # the same STEP_S period
            await pilot.pause(0.2)
            within = list(sent)
            held = tuple(row.step for row in table.rows)
            sent.clear()
            period[0] += 1  # the next period
            table.show(stepped, False, NOTHING)
            await pilot.pause(0.2)
            terminal.feed = feed  # type: ignore[method-assign]
            assert held == shown, (held, shown)
            return within, list(sent), tuple(row.step for row in table.rows), full_frame(app)

    within, after, steps, whole = asyncio.run(run())
    assert not "".join(within), within  # old: each row's new step, every round
    moved = [step for step in steps if step is not None]
    assert len(moved) >= 3
    # What Textual sent for them: a cursor move and the digit per row (styles apart: their
    # length is the colour depth's), not the rows.
    written = "".join(after)
    assert written and len(SGR.sub("", written)) <= 14 * len(moved), written
    assert terminal.cells == whole.cells  # and the terminal shows what a full frame shows


def test_a_frames_first_style_needs_no_reset_and_bold_ends_with_22() -> None:
    # Each frame the writer sends ends in the terminal's default style (a reset after the last
    # cell), so the frame's first style is written alone, not after another reset (4 bytes a
    # frame); from bold to plain in the same colours is "22", not a reset and the whole style.
    writer, terminal = CellDiff(), CellDiff()
    first = (  # as Rich writes segments: each in its style, then a reset
        "\x1b[1;1H\x1b[1;38;5;253;48;5;233mGPU 0\x1b[0m\x1b[38;5;253;48;5;233m 38.7 GiB\x1b[0m"
    )
    out = writer.feed(first)
    terminal.feed(out)
    assert out.startswith("\x1b[1;1H\x1b[1;38;5;253;48;5;233mGPU 0"), repr(out)
    assert "\x1b[0m\x1b[" not in out, repr(out)  # no reset just before a style
    assert "\x1b[22m 38.7 GiB" in out, repr(out)
    # A frame where only the plain figure moved: one move, one style, the changed cell.
    second = first.replace("38.7", "38.8")
    out = writer.feed(second)
    terminal.feed(out)
    assert out == "\x1b[1;10H\x1b[38;5;253;48;5;233m8\x1b[0m", repr(out)
    # The terminal (a model that reads the writer's output) shows what the input drew.
    assert terminal.cells == writer.cells
    assert terminal.cells[(1, 1)] == ("G", "1;38;5;253;48;5;233")
    assert terminal.cells[(1, 7)] == ("3", "38;5;253;48;5;233")


def test_a_frame_is_written_nearest_first_not_style_by_style_back_and_forth() -> None:
    # A slow period's frame in the `mixed` demo: on every row of the table the ALLOC figure
    # (in the row's colours) and the STEP figure (here in another style, as the cursor row's
    # or a dimmed one) moved.  Textual writes row by row: style A, B, A, B, … and a move
    # across the row each time; nearest first, one column goes down the rows in one style,
    # then the other: two styles written, not one per cell.
    a, b = "38;5;253;48;5;233", "38;5;16;48;5;214"
    rows = range(10, 20)

    def frame(alloc: str, step: str) -> str:  # whole rows, as Textual writes a region
        return "".join(
            f"\x1b[{row};30H\x1b[{a}m{alloc}{' ' * 40}\x1b[0m\x1b[{b}m{step}\x1b[0m\x1b[{a}m  "
            "\x1b[0m"
            for row in rows
        )

    writer, terminal = CellDiff(), CellDiff()
    terminal.feed(writer.feed(frame("14.0G", "601")))
    out = writer.feed(frame("15.1G", "602"))
    terminal.feed(out)
    assert terminal.cells == writer.cells  # the screen Textual drew
    assert len(SGR.findall(out)) <= 3, repr(out)  # A once, B once, the reset (was 20)
    assert len(out) <= 20 * len(rows), (len(out), repr(out))  # moves of a few bytes
