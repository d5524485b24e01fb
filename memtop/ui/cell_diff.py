"""Only the cells that changed go to the terminal (issue 12: bytes to the terminal ≤ 3× nvitop's).

Textual repaints whole lines of a widget region that changed: a GPU card whose used memory went
from 38.7 to 38.8 GiB costs the whole 120-column line with every style's escape sequence
(~500 bytes), where curses-based tools (nvitop, htop) write the two changed characters.  Over
SSH that difference is most of what a dashboard sends.

`CellDiff` sits between Textual and the terminal driver.  It keeps a copy of the screen (each
cell's character and SGR style), reads the stream Textual writes (cursor moves, SGR, text), and
emits only the runs of cells whose character or style differs from what the terminal already
shows, each after one cursor move and one style (in the order that costs fewest bytes).
Sequences it does not model pass through in order; anything that could put the terminal out
of step with the copy (erase, alternate screen, a resize) forgets the copy, so the next frame
goes out whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from itertools import repeat

from rich.cells import cell_len

# One token: a CSI sequence, an OSC string, another two-byte escape, a control character, or a
# run of printable text.
_TOKEN = re.compile(
    r"(?P<csi>\x1b\[(?P<params>[0-?]*)(?P<inter>[ -/]*)(?P<final>[@-~]))"
    r"|(?P<osc>\x1b\][^\x07\x1b]*(?:\x07|\x1b\\))"
    r"|(?P<esc>\x1b[@-Z\\-_0-9=>])"
    r"|(?P<ctl>[\x00-\x1a\x1c-\x1f\x7f])"
    r"|(?P<text>[^\x00-\x1f\x7f]+)"
)
_FORGET_PRIVATE = {"1049", "47", "1047"}  # alternate screen switches


class CellDiff:
    """A stateful filter: `feed(data)` returns what to write instead of `data`.

    The copy is kept per row, as a list of characters and a list of styles (None: never
    written), so that a run of text that is already on screen is recognised with two list
    comparisons rather than character by character: most of what Textual sends each second
    is a whole line of which one figure changed."""

    WIDTH_CACHE = 65536  # characters whose width is remembered

    def __init__(self) -> None:
        self._chars: dict[int, list[str | None]] = {}  # row (1-based) → column - 1 → char
        self._styles: dict[int, list[str | None]] = {}  # the SGR each cell was written in
        self._widths: dict[str, int] = {}
        self.row = 1  # where Textual's stream has put the cursor
        self.col = 1
        self.style = ""  # the SGR parameters in force in Textual's stream
        self.bytes_in = 0
        self.bytes_out = 0

    @property
    def cells(self) -> dict[tuple[int, int], tuple[str, str]]:
        """The copy as (row, col) → (character, style), 1-based (a wide character's second
        cell holds "")."""
        return {
            (row, col): (char, style or "")
            for row, chars in self._chars.items()
            for col, (char, style) in enumerate(zip(chars, self._styles[row], strict=True), 1)
            if char is not None
        }

    def forget(self) -> None:
        """The terminal may no longer show what the copy says: send everything next time."""
        self._chars.clear()
        self._styles.clear()

    def _line(self, row: int, end: int) -> tuple[list[str | None], list[str | None]]:
        """Row `row` of the copy, at least `end` cells long."""
        chars = self._chars.get(row)
        if chars is None:
            chars = self._chars[row] = []
            styles = self._styles[row] = []
        else:
            styles = self._styles[row]
        if len(chars) < end:
            pad = [None] * (end - len(chars))
            chars.extend(pad)
            styles.extend(pad)
        return chars, styles

    def _is_narrow(self, text: str) -> bool:
        """Every character of `text` takes one cell.  ASCII at once; otherwise each distinct
        character's width is looked up once (a run whose figures change every second is a new
        string every second, but made of the same few characters)."""
        if text.isascii():
            return True
        widths = self._widths
        for char in set(text):
            width = widths.get(char)
            if width is None:
                if len(widths) >= self.WIDTH_CACHE:
                    widths.clear()
                width = widths[char] = cell_len(char)
            if width != 1:
                return False
        return True

    # A frame's changed runs are written nearest first (the cheapest move and style change from
    # where the last left the cursor) up to this many; more (a full frame) in Textual's order,
    # whose search would cost more than it saves.
    REORDER_RUNS = 48

    def feed(self, data: str) -> str:
        out: list[str] = []
        # The changed runs not written yet, each (row, column, style, text, cells): written in
        # one go (`_flush`) at the end of the frame or before a sequence that must keep its
        # place, in the order that costs the fewest bytes.
        runs: list[tuple[int, int, str, str, int]] = []
        self._at: tuple[int, int] | None = None  # where the real cursor is after `out`
        self._out_style = ""  # the real terminal's SGR after `out` (each feed starts reset)
        for match in _TOKEN.finditer(data):
            kind = match.lastgroup
            if kind == "text":
                text = match.group("text")
                row, first, now = self.row, self.col - 1, self.style
                narrow = self._is_narrow(text)
                cells: Iterable[tuple[str, int]]
                if narrow:
                    span = len(text)
                    cells = zip(text, repeat(1))
                else:  # wide characters or combining marks (kept with their character)
                    cells = _clusters(text)
                    span = sum(width for _, width in cells)
                chars, styles = self._line(row, first + span)
                self.col += span
                end = first + span
                if narrow and chars[first:end] == list(text) and styles[first:end] == [now] * span:
                    continue  # the terminal shows this run already: two list comparisons
                column = first
                for char, width in cells:
                    if width == 0:  # a mark with nothing before it: passes through, in place
                        self._flush(runs, out)
                        out.append(char)
                        continue
                    if chars[column] != char or styles[column] != now:
                        last = runs[-1] if runs else None
                        if (
                            last
                            and last[0] == row
                            and last[1] + last[4] == column + 1
                            and last[2] == now
                        ):
                            runs[-1] = (row, last[1], now, last[3] + char, last[4] + width)
                        else:
                            runs.append((row, column + 1, now, char, width))
                        chars[column], styles[column] = char, now
                        if width == 2:
                            chars[column + 1], styles[column + 1] = "", now
                    column += width
            elif kind == "csi":
                final, params = match.group("final"), match.group("params")
                if final == "m" and not match.group("inter"):
                    if params in ("", "0"):
                        self.style = ""
                    elif params.startswith("0;"):
                        self.style = params[2:]
                    elif self.style:  # on top of a style: in one canonical form (_merged)
                        self.style = _merged(self.style, params)
                    else:
                        self.style = params
                elif final in "Hf" and not params.startswith("?"):
                    parts = params.split(";") if params else []
                    self.row = int(parts[0]) if parts and parts[0] else 1
                    self.col = int(parts[1]) if len(parts) > 1 and parts[1] else 1
                else:
                    self._flush(runs, out)
                    self._passthrough_csi(final, params, out)
                    self._at = None  # unknown effect on the cursor: move explicitly next time
            elif kind == "ctl":
                char = match.group("ctl")
                if char == "\r":
                    self.col = 1
                elif char == "\n":
                    self.row += 1
                else:
                    if char == "\b":
                        self.col = max(1, self.col - 1)
                    self._flush(runs, out)
                    out.append(char)
                    self._at = None
            else:  # OSC and other escapes: not modelled, kept in order
                self._flush(runs, out)
                out.append(match.group())
                self._at = None
        self._flush(runs, out)
        if self._out_style:
            out.append("\x1b[0m")
        result = "".join(out)
        self.bytes_in += len(data)
        self.bytes_out += len(result)
        return result

    def _flush(self, runs: list[tuple[int, int, str, str, int]], out: list[str]) -> None:
        """Write `runs` (and empty it) in Textual's order or nearest first, whichever costs
        fewer bytes (as estimated: the search must cost little beside the diff).  A frame's
        changes are a figure in the same column of many rows, a few cells of a card, the
        cursor row in a style of its own; in Textual's order the style went back and forth
        and the cursor across the screen (in the `mixed` demo 10-14 % of the bytes;
        bench/tty_where.py)."""
        if not runs:
            return
        order = runs
        if 1 < len(runs) <= self.REORDER_RUNS:
            nearest = list(self._nearest_first(list(runs)))
            if self._cost(nearest) < self._cost(runs):
                order = nearest
        written, self._at, self._out_style = self._written(order)
        runs.clear()
        out.append(written)

    def _cost(self, runs: list[tuple[int, int, str, str, int]]) -> int:
        """About the bytes of moves and styles that writing `runs` in this order takes."""
        at, style = self._at, self._out_style
        total = 0
        for row, col, now, _, cells in runs:
            total += 8 if at is None else _move_cost(row - at[0], col - at[1])
            total += _style_cost(style, now) if now != style else 0
            at, style = (row, col + cells), now
        return total

    def _written(
        self, runs: Iterable[tuple[int, int, str, str, int]]
    ) -> tuple[str, tuple[int, int] | None, str]:
        """`runs` as written in this order from where the last write left the cursor and the
        style; and where it leaves them."""
        at, style = self._at, self._out_style
        parts: list[str] = []
        for row, col, now, text, cells in runs:
            parts += (self._move(at, row, col, style), _sgr_change(style, now), text)
            at, style = (row, col + cells), now
        return "".join(parts), at, style

    def _nearest_first(
        self, runs: list[tuple[int, int, str, str, int]]
    ) -> Iterator[tuple[int, int, str, str, int]]:
        """`runs`, emptied, each time the one the cursor and the style as the last one left
        them reach in the fewest bytes (greedy: a frame holds a few dozen runs); from nowhere
        known, Textual's first (the moves after it are relative)."""
        at, style = self._at, self._out_style
        while runs:
            best, best_cost = 0, -1
            if at is not None:
                r0, c0 = at
                for index, (row, col, now, _, _) in enumerate(runs):
                    cost = _move_cost(row - r0, col - c0) + (
                        _style_cost(style, now) if now != style else 0
                    )
                    if best_cost < 0 or cost < best_cost:
                        best, best_cost = index, cost
                        if cost <= 1:
                            break  # adjacent, or a backspace away: none is cheaper
            run = runs.pop(best)
            yield run
            at, style = (run[0], run[1] + run[4]), run[2]

    def _passthrough_csi(self, final: str, params: str, out: list[str]) -> None:
        if final in "JK":  # erase: the copy no longer matches
            self.forget()
        elif final in "hl" and params.startswith("?"):
            if set(params[1:].split(";")) & _FORGET_PRIVATE:
                self.forget()
        elif final in "ABCD" and (params.isdigit() or not params):
            # A relative move (this class writes them: `_move`): followed, so that the copy
            # can also stand for a terminal that reads this class's own output (the tests').
            n = int(params or 1) or 1  # (0 moves one, as 1)
            if final == "A":
                self.row = max(1, self.row - n)
            elif final == "B":
                self.row += n
            elif final == "C":
                self.col += n
            else:
                self.col = max(1, self.col - n)
        elif final in "ABCDEFGd`":  # moves we do not track: be safe
            self.forget()
        out.append(f"\x1b[{params}{final}")

    def _move(self, at: tuple[int, int] | None, row: int, col: int, style: str) -> str:
        """The fewest bytes that put the real cursor, now at `at` (None: unknown), at (`row`,
        `col`): an absolute move (`ESC[17;79H`, 8 bytes), or a relative one from where it is
        (`ESC[B` and two backspaces: the same column of the next row; on one row, the cells
        in between written again as they are, where that is shorter).  Most of what changes
        each second is a figure in one column of many rows (a step counter, a percentage), so
        most moves are a row down and a few cells back.

        Relative only from a cell the copy knows on its row: there the terminal is at least
        that wide, so the cursor sits on that cell (not past the right margin, a wrap
        pending, where a backspace or a move down would land elsewhere)."""
        absolute = f"\x1b[{row};{col}H"
        if at is None:
            return absolute
        r0, c0 = at
        known = self._chars.get(r0)
        if known is None or len(known) < c0 or known[c0 - 1] is None:
            return absolute
        dr, dc = row - r0, col - c0
        vertical = ""
        if dr:
            vertical = "\x1b[" + (str(abs(dr)) if abs(dr) > 1 else "") + ("B" if dr > 0 else "A")
        horizontal = ""
        if dc < 0:
            horizontal = "\b" * -dc if -dc <= 4 else f"\x1b[{-dc}D"
        elif dc > 0:
            horizontal = f"\x1b[{dc}C" if dc > 1 else "\x1b[C"
            gap = self._rewrite(r0, c0, col, style) if dr == 0 else None
            if gap is not None and len(gap.encode()) < len(horizontal):
                horizontal = gap
        relative = vertical + horizontal
        return relative if len(relative.encode()) < len(absolute) else absolute

    def _rewrite(self, row: int, start: int, end: int, style: str) -> str | None:
        """The cells [start, end) of `row` as the terminal shows them, if writing them again
        in `style` changes nothing: each known, one cell wide and in that style."""
        chars, styles = self._chars[row], self._styles[row]
        if len(chars) < end - 1:
            return None
        if any(s != style for s in styles[start - 1 : end - 1]):
            return None
        cells = chars[start - 1 : end - 1]
        if any(c is None or len(c) != 1 or not self._is_narrow(c) for c in cells):
            return None
        return "".join(c for c in cells if c is not None)


# SGR attributes (bold … strike, double underline, frame, encircle, overline), as Rich writes
# them, in its order: attributes, then the foreground, then the background.
_SGR_ATTRIBUTES = frozenset({1, 2, 3, 4, 5, 6, 7, 8, 9, 21, 51, 52, 53})
_SGR_CACHE = 4096
_parsed_sgr: dict[str, tuple[frozenset[int], str, str] | None] = {}


def _parse_sgr(params: str) -> tuple[frozenset[int], str, str] | None:
    """SGR parameters as (attributes, foreground, background), each colour its parameters
    ("38;5;253", "31", "" for the default); None for anything else (left alone)."""
    if params in _parsed_sgr:
        return _parsed_sgr[params]
    attributes: set[int] = set()
    fg = bg = ""
    parts = params.split(";")
    parsed: tuple[frozenset[int], str, str] | None = None
    i = 0
    while i < len(parts):
        if not parts[i].isdigit():
            break
        n = int(parts[i])
        if n in (38, 48):
            size = {"5": 3, "2": 5}.get(parts[i + 1] if i + 1 < len(parts) else "", 0)
            code = parts[i : i + size]
            if not size or len(code) < size or not all(c.isdigit() for c in code):
                break
            fg, bg = (";".join(code), bg) if n == 38 else (fg, ";".join(code))
            i += size
            continue
        if n == 0:
            attributes.clear()
            fg = bg = ""
        elif 30 <= n <= 37 or 90 <= n <= 97:
            fg = parts[i]
        elif 40 <= n <= 47 or 100 <= n <= 107:
            bg = parts[i]
        elif n in (39, 49):
            fg, bg = ("", bg) if n == 39 else (fg, "")
        elif n in _SGR_ATTRIBUTES:
            attributes.add(n)
        elif n in _SGR_ENDS:
            attributes.difference_update(_SGR_ENDS[n])
        else:
            break
        i += 1
    else:
        parsed = (frozenset(attributes), fg, bg)
    if len(_parsed_sgr) >= _SGR_CACHE:
        _parsed_sgr.clear()
    _parsed_sgr[params] = parsed
    return parsed


def _merged(style: str, params: str) -> str:
    """The style in force after SGR `params` on top of `style`, as Rich would write it."""
    parsed = _parse_sgr(f"{style};{params}")
    if parsed is None:
        return f"{style};{params}"
    attributes, fg, bg = parsed
    return ";".join([*map(str, sorted(attributes)), *filter(None, (fg, bg))])


# The SGR parameter that turns an attribute off, and the attributes it turns off with it (22
# ends bold and faint, 24 single and double underline, …).
_SGR_OFF = {
    1: (22, (1, 2)),
    2: (22, (1, 2)),
    3: (23, (3,)),
    4: (24, (4, 21)),
    21: (24, (4, 21)),
    5: (25, (5, 6)),
    6: (25, (5, 6)),
    7: (27, (7,)),
    8: (28, (8,)),
    9: (29, (9,)),
    51: (54, (51, 52)),
    52: (54, (51, 52)),
    53: (55, (53,)),
}

_SGR_ENDS = {code: ends for code, ends in _SGR_OFF.values()}  # 22 → (1, 2), …


_sgr_changes: dict[tuple[str, str], str] = {}


def _sgr_change(old: str, new: str) -> str:
    """_sgr_delta, remembered (a screen has a few dozen styles; a frame changes between a few)."""
    change = _sgr_changes.get((old, new))
    if change is None:
        if len(_sgr_changes) >= _SGR_CACHE:
            _sgr_changes.clear()
        change = _sgr_changes[(old, new)] = _sgr_delta(old, new)
    return change


def _sgr_delta(old: str, new: str) -> str:
    """The SGR that turns the terminal's style `old` into `new`, in the fewest bytes: only
    what differs (a colour; an attribute turned off: bold's 22) where that is shorter than a
    reset and the whole style.  Most style changes between two changed cells are a colour or
    bold: "38;5;240" rather than a reset and "1;38;5;240;48;5;233".  From no style (`old`
    empty: the terminal's default, as each feed starts) the new style alone, without a reset
    before it."""
    if not old:
        return f"\x1b[{new}m" if new else ""
    whole = "\x1b[0m" + (f"\x1b[{new}m" if new else "")
    if not new:
        return whole
    before, after = _parse_sgr(old), _parse_sgr(new)
    if before is None or after is None:
        return whole
    off: list[int] = []
    back: set[int] = set()  # attributes an off code ended that `new` keeps: set again
    for attribute in sorted(before[0] - after[0]):
        code, ends = _SGR_OFF[attribute]
        if code not in off:
            off.append(code)
            back |= {a for a in ends if a in after[0]}
    parts = [str(n) for n in off]
    parts += [str(n) for n in sorted((after[0] - before[0]) | back)]
    if after[1] != before[1]:
        parts.append(after[1] or "39")
    if after[2] != before[2]:
        parts.append(after[2] or "49")
    if not parts:  # the same style written another way: nothing to change
        return ""
    delta = f"\x1b[{';'.join(parts)}m"
    return delta if len(delta) < len(whole) else whole


def _move_cost(dr: int, dc: int) -> int:
    """About the bytes of CellDiff._move's relative move by `dr` rows and `dc` columns (the
    order of a frame's runs is chosen on this, then each move is made exactly): a search
    that made every candidate move cost four times the frame's diffing."""
    vertical = 0 if not dr else 3 if -1 <= dr <= 1 else 4 + (dr >= 10 or dr <= -10)
    if not dc:
        return vertical
    if -4 <= dc < 0:
        return vertical - dc
    return vertical + (3 if dc == 1 else 4 + (dc >= 10 or dc <= -10) + (dc >= 100 or dc <= -100))


def _style_cost(old: str, new: str) -> int:
    return len(_sgr_change(old, new))


def _clusters(text: str) -> list[tuple[str, int]]:
    """`text` as (character with its combining marks, cells) pairs."""
    clusters: list[tuple[str, int]] = []
    for char in text:
        width = cell_len(char)
        if width == 0 and clusters:
            base, cells = clusters[-1]
            clusters[-1] = (base + char, cells)
        else:
            clusters.append((char, width))
    return clusters


def install(write: Callable[[str], None]) -> tuple[CellDiff, Callable[[str], None]]:
    """A write function that diffs before calling `write`."""
    diff = CellDiff()

    def diffed(data: str) -> None:
        out = diff.feed(data)
        if out:
            write(out)

    return diff, diffed
