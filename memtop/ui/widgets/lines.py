"""Rich Text straight to Textual strips, for the line-API widgets (the process table, the GPU
cards).

A widget's `render()` result goes through Textual's content pipeline (visualise, wrap, style,
strips) on every repaint: ~1 ms for a two-line GPU card.  These widgets lay out their own lines
(fixed widths, cut with …, never wrapped), so each line is turned into segments by Rich and
padded to the width: ~10 µs a line.
"""

from __future__ import annotations

from rich.console import Console
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.strip import Strip


def text_strip(console: Console, text: Text, width: int, style: Style) -> Strip:
    """One line of `text` under `style`, cut or padded to `width` cells."""
    segments = Segment.apply_style(text.render(console, end=""), style=style)
    return Strip(list(segments)).crop_extend(0, width, style)
