"""Rich Text straight to Textual strips, for the line-API widgets (the process table, the GPU
cards).

A widget's `render()` result goes through Textual's content pipeline (visualise, wrap, style,
strips) on every repaint: ~1 ms for a two-line GPU card.  These widgets lay out their own lines
(fixed widths, cut with …, never wrapped), so each line is cut into segments here, at its
spans' edges, and padded to the width.  The process table's rows are no Rich Text at all: the
table keeps each row's characters and style names and hands its pieces to `pieces_strip`.

Why not `Text.render`: the table repaints a row every second (its STEP moves), and on a busy
box every line is drawn with cold caches, where Rich's general path (a style stack, a style
parse per span, a generator per stage) cost ~95 µs a line against ~15 µs warm.  Here styles are
looked up once per combination, and the strip is made with its width already known: Rich
measures a string it has not seen one character at a time unless every character is in its
short list of one-cell characters, and "…" (every cut command) is not.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import pairwise

from rich.cells import cell_len
from rich.console import Console
from rich.control import strip_control_codes
from rich.segment import Segment
from rich.style import Style, StyleType
from rich.text import Span, Text
from textual.strip import Strip

# The characters beyond ASCII that memtop's lines draw most and that take one cell each, as Rich
# counts them (checked here): every cut command ends in "…", a figure not known is "—".  A line
# of these and printable ASCII is measured by its length, with no look-up per character.
_ONE_CELL = "".join(char for char in "…—·▾▼▲−█▁▂▃▄▅▆▇┃▕▏" if cell_len(char) == 1)
# Everything else: control characters take none, East Asian characters two, combining marks
# none.
_SPECIAL = re.compile(f"[^\\x20-\\x7e{re.escape(_ONE_CELL)}]")
# Characters whose width depends on their neighbours (joiners, variation selectors): a string
# holding one is measured whole, by Rich.
_JOINERS = re.compile("[\u200d\ufe0f]")


def cells(text: str) -> int:
    """The terminal cells `text` takes, as Rich counts them."""
    special = _SPECIAL.findall(text)
    if not special:
        return len(text)
    if _JOINERS.search(text):
        return cell_len(text)
    return len(text) + sum(cell_len(char) - 1 for char in special)


def cut(text: Text, width: int) -> Text:
    """`text` cut to `width` cells, as `Text.truncate(width)` cuts it, but measured here:
    Rich's `cell_len` keeps each string it measures in its cache (an LRU of 4,096), and
    memtop's lines hold figures that move every second (a GPU card's line was a new entry a
    card a second; issue 35 item 8).  A line of one-cell characters is cut by characters."""
    plain = text.plain
    if _SPECIAL.search(plain) is None and text.overflow in (None, "fold", "crop"):
        if len(plain) > width:
            text.right_crop(len(plain) - width)  # (Text.truncate: set_cell_size, the same)
    elif cells(plain) > width:
        text.truncate(width)
    return text


def looks_alike(a: Text, b: Text) -> bool:
    """Whether two texts draw the same: characters, spans and their own style (Rich's
    `Text.__eq__` leaves the last out)."""
    return a.plain == b.plain and a.spans == b.spans and a.style == b.style


_STYLES: dict[tuple[Style, tuple[StyleType, ...]], Style] = {}
_STYLES_MAX = 4096  # combinations: themes × focus × a few dozen span styles


def _style(console: Console, base: Style, layers: tuple[StyleType, ...]) -> Style:
    """`base` under the text's style and its spans, innermost last (as Rich stacks them)."""
    key = (base, layers)
    style = _STYLES.get(key)
    if style is None:
        if len(_STYLES) >= _STYLES_MAX:
            _STYLES.clear()
        null = Style.null()
        style = base + Style.combine(console.get_style(layer, default=null) for layer in layers)
        _STYLES[key] = style
    return style


# A line as its pieces: each piece's characters and its style layers, outermost first (the
# text's own style, then its spans'), the widget's style under them all.
Pieces = Sequence[tuple[str, tuple[StyleType, ...]]]


def text_strip(console: Console, text: Text, width: int, style: Style) -> Strip:
    """One line of `text` under `style`, cut or padded to `width` cells.  The text's own style
    applies with or without spans (Rich's `Text.render` drops it from a text with none)."""
    plain = text.plain
    spans = text.spans
    if not spans:
        return pieces_strip(console, plain, ((plain, (text.style,)),), width, style)
    end = len(plain)
    edges = sorted({0, end, *(min(s.start, end) for s in spans), *(min(s.end, end) for s in spans)})
    pieces = [
        (
            plain[start:stop],
            (text.style, *(s.style for s in spans if s.start <= start and s.end >= stop)),
        )
        for start, stop in pairwise(edges)  # distinct and sorted: never empty
    ]
    return pieces_strip(console, plain, pieces, width, style)


def pieces_strip(console: Console, plain: str, pieces: Pieces, width: int, style: Style) -> Strip:
    """One line under `style`, cut or padded to `width` cells: `plain` (its characters) in
    `pieces` (the same characters, each run under its own layers).  A widget that lays out its
    own lines (the process table's rows) draws them here with no Rich `Text` made for each."""
    segments = [Segment(piece, _style(console, style, layers)) for piece, layers in pieces if piece]
    used = cells(plain)
    if used < width:
        segments.append(Segment(" " * (width - used), style))
    strip = Strip(segments, max(used, width))
    return strip.crop(0, width) if used > width else strip


def changed_cells(old: Text, new: Text) -> tuple[int, int] | None:
    """The cells [x0, x1) in which `new` draws differently from `old`, when only characters
    changed in place (same style, same spans, same length, every character one cell): a STEP
    that moved.  None: anything else, so the whole line."""
    if old.style != new.style or old.spans != new.spans:
        return None
    return moved_cells(old.plain, new.plain)


def moved_cells(old: str, new: str) -> tuple[int, int] | None:
    """The cells [x0, x1) in which the characters of `new` differ from those of `old` drawn in
    the same styles, when they changed in place (same length, every character one cell).  None:
    anything else (or nothing moved), so the whole line."""
    if len(old) != len(new):
        return None
    if cells(old) != len(old) or cells(new) != len(new):
        return None  # a wide character or a mark: positions are not cells
    if old == new:
        return None  # the same characters: something else differs, so draw it all
    # Where they first and last differ, halving the string compared each time (a slice's
    # compare is one C call; a loop over the row's ~120 characters was ~15 us a row, and every
    # row's STEP moves every STEP_S).
    return _first_difference(old, new), len(old) - _first_difference(old[::-1], new[::-1])


def _first_difference(a: str, b: str) -> int:
    """The first index at which two different strings of one length differ."""
    same, differs = 0, len(a)  # a[:same] == b[:same]; a[:differs] != b[:differs]
    while differs - same > 1:
        middle = (same + differs) // 2
        if a[same:middle] == b[same:middle]:
            same = middle
        else:
            differs = middle
    return same


class LineText:
    """A line made piece by piece, then one Text: the same characters and spans as appending
    each piece to a Text in turn (`Text.append`: a piece's own style first, then its spans),
    for a fraction of the cost.  `Text.append` checks, cleans and measures each piece and
    makes its spans through a generator; a GPU card's line is ~17 pieces, and every card is
    laid out again together each slow period (a quarter of laying a card out; issue 35
    item 8)."""

    __slots__ = ("_length", "_spans", "_texts")

    def __init__(self) -> None:
        self._texts: list[str] = []
        self._spans: list[Span] = []
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def add(self, text: str, style: StyleType = "") -> LineText:
        """As `Text.append(text, style)`."""
        if text:
            if not text.isprintable():  # (the control codes it strips are not printable)
                # Most pieces are the card's own words and glyphs: str.translate looks each
                # character of a non-ASCII piece (a bar's █ run) up in a dict, ~a sixth of
                # laying a card out, where isprintable is one pass in C.
                text = strip_control_codes(text)
            end = self._length + len(text)
            if style:
                self._spans.append(Span(self._length, end, style))
            self._texts.append(text)
            self._length = end
        return self

    def add_text(self, text: Text | LineText) -> LineText:
        """As `Text.append(text)` of a Text (its style a span over it, then its spans)."""
        if isinstance(text, LineText):
            offset = self._length
            self._texts.extend(text._texts)
            self._spans.extend(Span(offset + s, offset + e, style) for s, e, style in text._spans)
            self._length += text._length
            return self
        length = len(text)
        if length:
            offset = self._length
            if text.style:
                self._spans.append(Span(offset, offset + length, text.style))
            self._texts.append(text.plain)
            self._spans.extend(Span(offset + s, offset + e, style) for s, e, style in text.spans)
            self._length += length
        return self

    def text(self, style: StyleType = "") -> Text:
        """The line as one Text with `style` its own (a Text made with it, then appended to)."""
        return Text("".join(self._texts), style=style, spans=self._spans)
