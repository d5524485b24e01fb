"""memtop.ui.cell_diff: the terminal ends up showing exactly what Textual drew, with far fewer
bytes when little changed."""

from __future__ import annotations

import random
import re

import pytest

from memtop.ui.cell_diff import CellDiff


def screen(stream: str) -> dict[tuple[int, int], tuple[str, str]]:
    """What a terminal shows after `stream` (cell → character and style)."""
    model = CellDiff()
    model.feed(stream)
    return model.cells


class Terminals:
    """Two terminals, one sent the full frames and one the diffed ones, fed a frame at a time:
    what `screen` of each stream so far would give, without parsing the whole stream again
    after every frame (which made these tests quadratic: 300 frames were 10 CPU-s).  A
    terminal's state carries over from one write to the next, and every frame and every diffed
    write ends on a whole sequence (the synchronized-output end), so feeding them one by one is
    feeding their concatenation; `screen` of the whole streams checks that at the end."""

    def __init__(self) -> None:
        self.full = CellDiff()
        self.sent = CellDiff()

    def feed(self, full: str, sent: str) -> None:
        self.full.feed(full)
        self.sent.feed(sent)

    def same(self) -> bool:
        return self.sent.cells == self.full.cells


def frame(lines: dict[int, list[tuple[str, str]]]) -> str:
    """A stream as Textual writes one: per line a cursor move, then styled segments."""
    out = ["\x1b[?2026h"]
    for row, segments in lines.items():
        out.append(f"\x1b[{row};1H")
        for text, style in segments:
            out.append(f"\x1b[{style}m{text}\x1b[0m" if style else text)
        out.append("\r\n")
    out.append("\x1b[?2026l")
    return "".join(out)


def test_only_changed_cells_are_written_and_the_screen_matches():
    rng = random.Random(7)
    diff = CellDiff()
    full: list[str] = []
    sent: list[str] = []
    lines = {
        row: [(f"GPU {row} ", "1;38;5;253"), ("█" * 20, "38;5;112"), (" 38.7 GiB", "")]
        for row in range(1, 9)
    }
    for _ in range(50):
        row = rng.randrange(1, 9)
        value = f" {rng.uniform(10, 80):4.1f} GiB"
        lines[row] = [*lines[row][:2], (value, "")]
        stream = frame(lines)
        full.append(stream)
        sent.append(diff.feed(stream))
    assert screen("".join(sent)) == screen("".join(full))
    assert sum(map(len, sent[1:])) < sum(map(len, full[1:])) / 10


def test_style_changes_are_changes_and_erase_forgets():
    diff = CellDiff()
    first = diff.feed("\x1b[1;1H\x1b[32mok\x1b[0m")
    assert "ok" in first
    assert diff.feed("\x1b[1;1H\x1b[32mok\x1b[0m") == ""  # nothing changed: nothing sent
    red = diff.feed("\x1b[1;1H\x1b[31mok\x1b[0m")
    assert "31" in red and "ok" in red
    assert diff.feed("\x1b[2J") == "\x1b[2J"
    assert "ok" in diff.feed("\x1b[1;1H\x1b[31mok\x1b[0m")  # after an erase: sent again


def test_wide_characters_and_unmodelled_sequences_pass_in_order():
    diff = CellDiff()
    out = diff.feed("\x1b[?25l\x1b[3;5H日本\x1b]0;title\x07x")
    assert out.startswith("\x1b[?25l") and "日本" in out and "\x1b]0;title\x07" in out
    assert diff.cells[(3, 5)] == ("日", "") and diff.cells[(3, 9)] == ("x", "")


@pytest.mark.slow
def test_random_frames_of_mixed_widths_end_on_the_same_screen():
    # ASCII, one-cell symbols (bars, box drawing), wide CJK and a combining accent, in random
    # styles: after every frame the diffed stream leaves the terminal as the full one would.
    rng = random.Random(11)
    alphabet = ["a", "7", " ", "█", "▁", "─", "…", "日", "e\u0301"]
    styles = ["", "1", "38;5;112", "1;31"]
    diff = CellDiff()
    full: list[str] = []
    sent: list[str] = []
    lines: dict[int, list[tuple[str, str]]] = {}
    terminals = Terminals()
    for _ in range(200):
        row = rng.randrange(1, 6)
        lines[row] = [
            ("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 12))), rng.choice(styles))
            for _ in range(rng.randrange(1, 5))
        ]
        stream = frame(lines)
        full.append(stream)
        sent.append(diff.feed(stream))
        terminals.feed(full[-1], sent[-1])
        assert terminals.same()
    assert screen("".join(sent)) == screen("".join(full))
    assert diff.feed(frame(lines)) == "\x1b[?2026h\x1b[?2026l"  # nothing changed: nothing drawn


def test_a_figure_that_moves_in_one_column_of_many_rows_costs_a_few_bytes_a_row():
    # Issue 35, item 8: each second the step counters (one column, every row) move.  An
    # absolute move to each (ESC[17;79H) cost 8 bytes for a digit or two; a row down and back
    # to the column costs 4-5, and a gap of unchanged cells between two changed ones on a row
    # is written again as it is where that is shorter than a move over it.
    def table(steps: list[int], used: str) -> dict[int, list[tuple[str, str]]]:
        return {
            row: [("│ ", ""), (f"{7200 + row:8d} root  {used}  {step:6d} ", "38;5;253"), ("│", "")]
            for row, step in enumerate(steps, start=3)
        }

    diff = CellDiff()
    steps = [195, 194, 201, 197, 195, 192, 198, 196]
    full = [frame(table(steps, "38.7G"))]
    sent = [diff.feed(full[0])]
    for second in range(1, 6):
        moved = [step + 7 * second for step in steps]
        full.append(frame(table(moved, "38.7G" if second < 5 else "39.1G")))
        sent.append(diff.feed(full[-1]))
    assert screen("".join(sent)) == screen("".join(full))
    for out in sent[1:5]:  # the last one to three digits of each of 8 rows
        # One absolute move (to the first row), then a row down and back to the column.
        assert len(re.findall(r"\x1b\[\d+;\d+H", out)) == 1, repr(out)
        assert len(out.encode()) <= 100, repr(out)  # an absolute move to each: 109-112
    # "38.7G" → "39.1G": the unchanged "." between two changed digits is written, not jumped.
    assert "9.1" in sent[5], sent[5]


def test_a_change_of_colour_between_changed_cells_sends_only_the_colour():
    # Issue 35, item 8: a card's figures alternate bold white and dim grey on one background;
    # each switch was a reset and the whole style (ESC[0m ESC[1;38;5;240;48;5;233m, 27 bytes).
    white, grey = "1;38;5;253;48;5;233", "1;38;5;240;48;5;233"

    def card(step: int) -> dict[int, list[tuple[str, str]]]:
        return {3: [(f"used {step:3d} ", white), (f"frag 0.{step % 10}", grey)]}

    diff = CellDiff()
    full = [frame(card(1))]
    sent = [diff.feed(full[0])]
    full.append(frame(card(2)))
    sent.append(diff.feed(full[1]))
    assert "\x1b[38;5;240m" in sent[1] and f"\x1b[0m\x1b[{grey}m" not in sent[1], repr(sent[1])
    assert screen("".join(sent)) == screen("".join(full))


@pytest.mark.slow
def test_random_frames_in_colours_on_backgrounds_end_on_the_same_screen():
    rng = random.Random(5)
    styles = [
        "",
        "1",
        "1;38;5;253;48;5;233",
        "1;38;5;240;48;5;233",
        "38;5;16;48;5;214",
        "38;5;253;48;5;233",
        "1;4;31",
        "2;38;2;10;20;30",
        "7;48;5;234",
    ]
    diff = CellDiff()
    full: list[str] = []
    sent: list[str] = []
    lines: dict[int, list[tuple[str, str]]] = {}
    terminals = Terminals()
    for _ in range(300):
        row = rng.randrange(1, 6)
        lines[row] = [
            ("".join(rng.choice("ab7 .█") for _ in range(rng.randrange(1, 9))), rng.choice(styles))
            for _ in range(rng.randrange(1, 6))
        ]
        stream = frame(lines)
        full.append(stream)
        sent.append(diff.feed(stream))
        terminals.feed(full[-1], sent[-1])
        assert terminals.same()
    assert screen("".join(sent)) == screen("".join(full))
    assert sum(map(len, sent[1:])) < sum(map(len, full[1:])) / 2


@pytest.mark.parametrize("colour", ["", "38;5;240;48;5;233"])
@pytest.mark.parametrize(("kept", "ended"), [(1, 2), (2, 1), (4, 21), (21, 4), (5, 6), (51, 52)])
def test_an_attribute_ended_with_its_sibling_is_set_again(kept: int, ended: int, colour: str):
    # One SGR code ends two attributes (22 bold and faint, 24 single and double underline, 25
    # both blinks, 54 framed and encircled): from bold + faint to bold alone, the change is 22
    # and then bold again.  The random frames' styles never hold both of a pair, so dropping
    # the "set again" (`back` in _sgr_delta) failed no test before this one.
    both = ";".join([*map(str, sorted({kept, ended})), *filter(None, [colour])])
    alone = ";".join([str(kept), *filter(None, [colour])])
    full = frame({3: [("ab", both), ("cd", alone), ("ef", both)]})
    sent = CellDiff().feed(full)
    assert screen(sent) == screen(full), repr(sent)
    assert screen(sent)[(3, 3)] == ("c", alone)
    # Each change is the difference alone, never a reset and the whole style: the path tested.
    assert sent.count("\x1b[0m") == 1 and sent.endswith("\x1b[0m"), repr(sent)
