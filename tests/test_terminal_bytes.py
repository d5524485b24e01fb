"""What the dashboard writes to the terminal each second (issue 35 item 8: bytes ≤ nvitop's).

Measured with bench/tui_cost.py --record and bench/tty_where.py on the `mixed` demo (11
agents on 8 GPUs): the table's STEP column was a third of the bytes, a rank's held allocated
bytes renewed with its GPU's news a fifth (tests/test_renewal.py), and each frame's first
style began with a reset the terminal did not need."""

from __future__ import annotations

from memtop.ui.cell_diff import CellDiff


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
