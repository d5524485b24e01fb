"""Rich Text straight to Textual strips, for the line-API widgets (the process table, the GPU
cards).

A widget's `render()` result goes through Textual's content pipeline (visualise, wrap, style,
strips) on every repaint: ~1 ms for a two-line GPU card.  These widgets lay out their own lines
(fixed widths, cut with …, never wrapped), so each line is cut into segments here, at its
spans' edges, and padded to the width.

Why not `Text.render`: the table repaints a row every second (its STEP moves), and on a busy
box every line is drawn with cold caches, where Rich's general path (a style stack, a style
parse per span, a generator per stage) cost ~95 µs a line against ~15 µs warm.  Here styles are
looked up once per combination, and the strip is made with its width already known: Rich
measures a string it has not seen one character at a time unless every character is in its
short list of one-cell characters, and "…" (every cut command) is not.
"""

from __future__ import annotations

import re
from itertools import pairwise

from rich.cells import cell_len
from rich.console import Console
from rich.segment import Segment
from rich.style import Style, StyleType
from rich.text import Text
from textual.strip import Strip

# Everything but printable ASCII (one cell each): control characters take none, East Asian
# characters two, combining marks none.
_SPECIAL = re.compile(r"[^\x20-\x7e]")
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


def text_strip(console: Console, text: Text, width: int, style: Style) -> Strip:
    """One line of `text` under `style`, cut or padded to `width` cells.  The text's own style
    applies with or without spans (Rich's `Text.render` drops it from a text with none)."""
    plain = text.plain
    spans = text.spans
    segments: list[Segment] = []
    if not spans:
        if plain:
            segments.append(Segment(plain, _style(console, style, (text.style,))))
    else:
        end = len(plain)
        edges = sorted(
            {0, end, *(min(s.start, end) for s in spans), *(min(s.end, end) for s in spans)}
        )
        for start, stop in pairwise(edges):  # distinct and sorted: never empty
            layers = (text.style, *(s.style for s in spans if s.start <= start and s.end >= stop))
            segments.append(Segment(plain[start:stop], _style(console, style, layers)))
    used = cells(plain)
    if used < width:
        segments.append(Segment(" " * (width - used), style))
    strip = Strip(segments, max(used, width))
    return strip.crop(0, width) if used > width else strip


def changed_cells(old: Text, new: Text) -> tuple[int, int] | None:
    """The cells [x0, x1) in which `new` draws differently from `old`, when only characters
    changed in place (same style, same spans, same length, every character one cell): a STEP
    that moved.  None: anything else, so the whole line."""
    a, b = old.plain, new.plain
    if len(a) != len(b) or old.style != new.style or old.spans != new.spans:
        return None
    if cells(a) != len(a) or cells(b) != len(b):
        return None  # a wide character or a mark: positions are not cells
    moved = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    if not moved:
        return None  # the same characters: something else differs, so draw it all
    return moved[0], moved[-1] + 1
