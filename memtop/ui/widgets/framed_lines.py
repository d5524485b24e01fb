"""A widget's content lines put in their frame (border, padding) once a style, not once a line.

Textual draws every line of a widget through its `StylesCache.render_line`, which works the
widget's frame out again for each one: its border's four edges and colours, its outline, its
padding, its tint, opacity and hatch, the styles of the border's two sides.  For a content line
of a widget with none of the effects that change the content (tint, opacity, text opacity,
hatch), all that makes the same few segments on either side of the line.  The process table
draws a line per row whose STEP moved, every row every two seconds: Textual's frame was ~25 us
of each ~35 us line (issue 35 item 8).

`FramedLinesCache` asks Textual's own `render_line` once what it puts around a content line (a
stand-in line of the content's width: the segments before and after it, where the stand-in
comes back as the very object it was), and from then on puts each content line between those.
Where Textual changes the content (the stand-in does not come back as it went), or for any
other line (a border row, a title), it is Textual's `render_line` as before.  What it learnt is
forgotten when the cache is cleared (every change of a style repaints the widget whole, which
clears it) and whenever the drawing's sizes, colours or opacity differ from those it was learnt
with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.segment import Segment
from textual._styles_cache import StylesCache
from textual.strip import Strip

# A frame as learnt: what Textual's render_line was given that could change it (sizes, padding,
# colours, opacity, theme), the content lines' span [top, bottom) in the widget, the segments
# before a content line and those after it; None for both where Textual changes the line itself
# (then every line is Textual's own until the styles or sizes change).
Frame = tuple[tuple[object, ...], int, int, tuple[Segment, ...] | None, tuple[Segment, ...] | None]


class FramedLinesCache(StylesCache):
    """Textual's StylesCache, its content lines framed by what Textual framed a stand-in with."""

    def __init__(self) -> None:
        super().__init__()
        self._frame: Frame | None = None

    def clear(self) -> None:
        self._frame = None  # (a style changed, or the width: the widget repaints whole)
        super().clear()

    def forget_frame(self) -> None:
        """Learn the frame again at the next line (the widget's CSS changed)."""
        self._frame = None

    def render_line(
        self,
        styles: Any,
        y: int,
        size: Any,
        content_size: Any,
        padding: Any,
        base_background: Any,
        background: Any,
        render_content_line: Callable[[int], Strip],
        *rest: Any,
    ) -> Strip:
        # rest: the border's title and subtitle, opacity, ANSI theme, native ANSI (Textual 8).
        key = (size, content_size, padding, base_background, background, *rest[2:])
        frame = self._frame
        if frame is None or frame[0] != key:
            frame = self._frame = self._learn(
                styles, size, content_size, padding, base_background, background, key, rest
            )
        _, top, bottom, before, after = frame
        if before is not None and after is not None and top <= y < bottom:
            line = render_content_line(y - top)
            if line.cell_length == content_size.width:  # (else Textual pads or cuts it)
                return Strip([*before, *line, *after], size.width)
        return super().render_line(
            styles,
            y,
            size,
            content_size,
            padding,
            base_background,
            background,
            render_content_line,
            *rest,
        )

    def _learn(
        self,
        styles: Any,
        size: Any,
        content_size: Any,
        padding: Any,
        base_background: Any,
        background: Any,
        key: tuple[object, ...],
        rest: tuple[Any, ...],
    ) -> Frame:
        """What Textual puts around a content line, from a stand-in line of the content's width
        drawn by Textual: the segments before it and after it, where it comes back untouched."""
        gutter = styles.gutter
        top = gutter.top
        bottom = min(size.height - gutter.bottom, top + content_size.height)
        width = content_size.width
        # An outline draws over the first and last lines whatever they are: Textual's own way.
        if width <= 0 or bottom <= top or any(edge for edge, _ in styles.outline):
            return key, top, bottom, None, None
        stand_in = Segment(" " * width)
        drawn = list(
            super().render_line(
                styles,
                top,
                size,
                content_size,
                padding,
                base_background,
                background,
                lambda _: Strip([stand_in], width),
                *rest,
            )
        )
        at = [index for index, segment in enumerate(drawn) if segment is stand_in]
        if len(at) != 1:  # tinted, faded, hatched: the line itself changed
            return key, top, bottom, None, None
        return key, top, bottom, tuple(drawn[: at[0]]), tuple(drawn[at[0] + 1 :])
