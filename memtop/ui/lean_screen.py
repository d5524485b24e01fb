"""A screen whose partial updates render only the widgets that paint inside the update.

Textual's compositor, for a partial update, takes the box around every dirty region and renders
each visible widget whose *clip* (its container's region) overlaps that box.  A top-level
widget's clip is the whole screen, so the header, the status line, the footer and every
container render in every frame, whatever changed: on the dashboard, where a frame a second
changes eight table cells, that was most of the widgets rendered (bench/tui_cost.py, issue 12).

`LeanCompositor` keeps a widget only when the part of it that shows (its region within its
clip) holds a dirty cell, and renders only its lines that do: exactly the widgets and lines that
can paint a cell of the update, so the frame is the same.  Textual rendered every line of every
widget inside the box around all dirty regions: a STEP cell in the table and a figure in a GPU
card made the box most of the screen, and each of its widgets' lines was cropped into a new strip
(Strip.crop and Strip.__init__ were a fifth of the dashboard's CPU; bench/tui_cost.py, issue 35).
The lines it does not render are blank placeholders: the update writes only dirty cells, and a
line without one is never written.  Nor does it render a widget's line whose dirty cells all lie
under widgets in front of it (Textual keeps, of each run of cells between widgets' edges, the
front widget's strip): a container's lines under its children that changed, and the screen's
under everything, were most of the lines a frame rendered (1,050 of 1,400 in 29 s of the mixed
demo; issue 35 item 8).

Its updates (`SpanUpdate`) also write only the cells of each dirty span.  Textual's write the
span's line from the start of the widget that covers it: a table row whose STEP changed went out
from the table's left border to the STEP column, eighty cells for four, to be diffed away again
by memtop.ui.cell_diff.

Rich and Textual remember, each in an LRU of 16,384 entries, how a segment of a line splits at a
cell (`Segment._split_cells`, on every crop and every division of a line into chops) and the
escape sequence of each style (`Strip.render_ansi`).  Their keys are the lines' contents, and a
dashboard's figures change every second: each new figure is a new entry, ~1 KiB each, ~300 a
minute on a dashboard with trainers coming and going, so the caches grew for most of an hour
(0.5-0.7 MB a minute, issue 36) before Rich's cap held them, at ~16 MB.  Rich's `cached_cell_len`
(4,096 entries, ~320 B each) measures every segment of a line the compositor divides into chops
(the suggestions pane's, at its scrollbar): ~40 new strings a minute in the mixed demo once
memtop measured its own lines (issue 35 item 8), so it too filled in an hour or two, to ~1.3 MB.
A frame that finds one of them holding more than TEXT_CACHE_ENTRIES empties it
(`trim_text_caches`): what is drawn again next second is cached again at once.

A line that is one chop whole is taken as it is, not through `Strip.divide`, which keeps its
answer (a list of the strip itself) in the strip's own cache: a reference cycle a line drawn
anew, left to the cyclic collector (`LeanCompositor._render_chops`, issue 35 item 8).

Everything else is Textual's own (`Compositor._get_renders`, `_render_chops`' loop,
`_regions_to_spans`, `ChopsUpdate`, textual 8.x);
should a later Textual change what this relies on, the screen falls back to Textual's compositor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import rich.cells
from rich.cells import get_character_cell_size
from rich.color import ColorSystem
from rich.console import Console
from rich.segment import Segment
from textual._compositor import ChopsUpdate, Compositor
from textual.geometry import Region
from textual.screen import Screen
from textual.strip import Strip

# Entries a content-keyed cache of Rich's or Textual's may hold before a frame empties it: a
# screen's worth of lines and styles (120 × 50 cells divide into far fewer), ~2 MiB at most.
TEXT_CACHE_ENTRIES = 2048


def _text_caches() -> tuple[Any, ...]:
    """The functools LRU caches of Rich and Textual keyed by what a line contains (any that a
    later Rich or Textual renamed or dropped is left out)."""
    candidates = [
        getattr(vars(owner).get(name), "__func__", None)
        for owner, name in ((Segment, "_split_cells"), (Strip, "render_ansi"))
    ]
    candidates.append(getattr(rich.cells, "cached_cell_len", None))
    return tuple(
        cached
        for cached in candidates
        if callable(getattr(cached, "cache_info", None))
        and callable(getattr(cached, "cache_clear", None))
    )


TEXT_CACHES = _text_caches()


def trim_text_caches(limit: int = TEXT_CACHE_ENTRIES, caches: Iterable[Any] = TEXT_CACHES) -> None:
    """Empty each of `caches` that holds more than `limit` entries."""
    for cache in caches:
        if cache.cache_info().currsize > limit:
            cache.cache_clear()


# Anything but printable ASCII: a character whose width is looked up.
_SPECIAL = re.compile(r"[^\x20-\x7e]")


def _one_cell_each(text: str) -> bool:
    """Whether each character of `text` is one cell on its own: printable ASCII, or in the
    Basic Multilingual Plane and one cell wide ("…", "│", "█", a braille dot).  None then
    joins its neighbours into a cluster (those are marks, joiners and selectors, of no width,
    or pairs of regional indicators, outside the plane)."""
    return all(
        special <= "\uffff" and get_character_cell_size(special) == 1
        for special in set(_SPECIAL.findall(text))
    )


def render_cells(strip: Strip, start: int, stop: int, console: Console) -> str:
    """What `strip.crop(start, stop).render(console)` writes, for a strip whose every character
    is one cell (`_one_cell_each`): sliced by characters, without the new Strip a crop makes
    and measures (Strip.crop was a twentieth of the dashboard's samples, most of it cutting a
    table row or a card's line down to the cells that changed; issue 35 item 8)."""
    color_system = console._color_system or ColorSystem.TRUECOLOR
    render = strip.render_style
    pieces = []
    at = 0
    for text, style, _ in strip:
        after = at + len(text)
        if after > start and at < stop:
            piece = text[max(0, start - at) : stop - at]
            pieces.append(piece if style is None else render(style, piece, color_system))
        elif at >= stop:
            break
        at = after
    return "".join(pieces)


class SpanUpdate(ChopsUpdate):
    """A partial update that writes each dirty span's cells and no others."""

    def render_segments(self, console: Console) -> str:
        sequences: list[str] = []
        append = sequences.append
        chops, chop_ends = self.chops, self.chop_ends
        last_y = self.spans[-1][0]
        for y, x1, x2 in self.spans:  # x2: the first cell after the span
            for end, (x, strip) in zip(chop_ends[y], chops[y].items(), strict=False):
                if strip is None:
                    continue
                start, stop = max(x, x1), min(end, x2)
                one_cell_each = False
                if start != x or stop != end:
                    text = strip.text
                    if strip.cell_length != len(text):
                        start = x  # a wide character may straddle x1: from the chop, as Textual
                    else:
                        one_cell_each = _one_cell_each(text)
                if stop <= start:
                    continue
                append(f"\x1b[{y + 1};{start + 1}H")  # Control.move_to's sequence
                if start == x and stop == end:
                    append(strip.render(console))
                elif one_cell_each:  # cells are characters: the span's, cut from the segments
                    append(render_cells(strip, start - x, stop - x, console))
                else:
                    append(strip.crop(start - x, stop - x).render(console))
            if y != last_y:
                append("\n")  # as Textual writes it
        return "".join(sequences)


class LeanCompositor(Compositor):
    def __init__(self) -> None:
        super().__init__()
        # While a partial update renders: each dirty line's spans [x1, x2), by screen line.
        self._dirty_rows: dict[int, list[tuple[int, int]]] | None = None

    def render_update(self, *args: Any, **kwargs: Any) -> Any:
        trim_text_caches()  # once a frame: a few calls of cache_info()
        return super().render_update(*args, **kwargs)

    def render_partial_update(self) -> ChopsUpdate | None:
        # Textual's render_partial_update, but for the dirty rows kept for _get_renders.
        update_regions = self._dirty_regions.copy()
        self._dirty_regions.clear()
        if not update_regions:
            return None
        crop = Region.from_union(update_regions).intersection(self.size.region)
        spans = list(self._regions_to_spans(update_regions))
        rows: dict[int, list[tuple[int, int]]] = {}
        for y, x1, x2 in spans:
            rows.setdefault(y, []).append((x1, x2))
        self._dirty_rows = rows
        try:
            chops = self._render_chops(crop, rows.__contains__)
        finally:
            self._dirty_rows = None
        chop_ends = [cut_set[1:] for cut_set in self.cuts]
        return SpanUpdate(chops, spans, chop_ends)

    def _render_chops(
        self, crop: Region, is_rendered_line: Callable[[int], bool]
    ) -> Sequence[Mapping[int, Strip]]:
        """Textual's `_render_chops` (textual 8.x), but for a line that is one chop whole: that
        is the strip itself, as `Strip.divide` returns it, without asking `divide`, which keeps
        its answer `[strip]` in the strip's own cache, a reference cycle.  Each such strip (a
        widget's line drawn anew: ~9 a round in the `mixed` demo, each with its seven caches
        and its segments, ~170 objects) was then freed only by the cyclic collector, which the
        dashboard runs rarely (memtop.ui.app: GC_GEN0_THRESHOLD); one still drawn when a
        collection ran was moved to an older generation and waited there for a full one."""
        cuts = self.cuts
        chops: list[dict[int, Strip | None]] = [dict.fromkeys(cut_set[:-1]) for cut_set in cuts]
        intersection = Region.intersection
        for region, clip, strips in self._get_renders(crop):
            render_region = intersection(region, clip)
            render_x = render_region.x
            first_cut, last_cut = render_region.column_span
            for y, strip in zip(render_region.line_range, strips, strict=False):
                if not is_rendered_line(y):
                    continue
                chops_line = chops[y]
                final_cuts = [cut for cut in cuts[y] if last_cut >= cut >= first_cut]
                length = strip.cell_length
                inner = [cut - render_x for cut in final_cuts[1:] if cut - render_x <= length]
                cut_strips = (strip,) if inner == [length] else strip.divide(inner)
                # Front to back: the first strip given for a chop is the one that shows.
                get_chops_line = chops_line.get
                for cut, piece in zip(final_cuts, cut_strips, strict=False):
                    if get_chops_line(cut) is None:
                        chops_line[cut] = piece
        return cast("Sequence[Mapping[int, Strip]]", chops)

    def _get_renders(
        self, crop: Region | None = None
    ) -> Iterable[tuple[Region, Region, list[Strip]]]:
        rows = self._dirty_rows
        if crop is None or rows is None:  # a full frame: every widget, as Textual does it
            yield from super()._get_renders(crop)
            return
        overlaps = crop.overlaps
        intersection = Region.intersection
        # The dirty cells no widget drawn so far covers, by line.  Widgets come front to back,
        # and `_render_chops` keeps, of each chop (a run of cells between widgets' edges), the
        # first strip it is given: a widget's line whose dirty cells all lie under widgets
        # already drawn would be cut up and thrown away.  A container's line under its
        # children, the screen's under everything (a third of the lines drawn, issue 35).
        uncovered = {y: list(spans) for y, spans in rows.items()}
        for widget, (region, clip) in self.visible_widgets.items():
            if not uncovered:
                break  # every dirty cell has its widget: the rest lie underneath
            shown = intersection(region, clip)
            if not shown.area or not overlaps(shown):
                continue  # paints no cell of the update
            left, right = shown.x, shown.right
            top, bottom = shown.y, shown.bottom
            lines = []
            # Its lines that hold dirty cells, top down: a few of the dirty lines, not each
            # line of the widget looked up (the screen's and its containers' dozens a frame).
            for y in sorted(y for y in uncovered if top <= y < bottom):
                spans = uncovered[y]
                if not any(x1 < right and x2 > left for x1, x2 in spans):
                    continue  # each dirty cell here lies under a widget above
                lines.append(y)
                # Its cells are this widget's now: what is left of the spans either side.
                rest = [(x1, min(x2, left)) for x1, x2 in spans if x1 < left]
                rest += [(max(x1, right), x2) for x1, x2 in spans if x2 > right]
                if rest:
                    uncovered[y] = rest
                else:
                    del uncovered[y]
            if not lines:
                continue  # the box around the update overlaps it, but no uncovered dirty cell
            blank = Strip.blank(shown.width)
            strips = [blank] * shown.height
            # Each run of consecutive dirty lines in one call, in the widget's own coordinates.
            start = 0
            for index in range(1, len(lines) + 1):
                if index < len(lines) and lines[index] == lines[index - 1] + 1:
                    continue
                first, count = lines[start], index - start
                strips[first - shown.y : first - shown.y + count] = widget.render_lines(
                    Region(shown.x - region.x, first - region.y, shown.width, count)
                )
                start = index
            yield region, clip, strips


def lean_compositor_fits() -> bool:
    """Whether this Textual's compositor has what LeanCompositor overrides and reads."""
    return (
        callable(getattr(Compositor, "_get_renders", None))
        and callable(getattr(Compositor, "render_partial_update", None))
        and callable(getattr(Compositor, "_render_chops", None))
        and callable(getattr(Compositor, "_regions_to_spans", None))
        and hasattr(Compositor(), "_dirty_regions")
        and isinstance(getattr(Compositor, "cuts", None), property)  # _render_chops reads it
        and isinstance(getattr(Compositor, "visible_widgets", None), property)
        and callable(getattr(ChopsUpdate, "render_segments", None))
        and callable(getattr(Strip, "render_style", None))  # render_cells' writer
    )


class LeanScreen(Screen[None]):
    """A Screen with LeanCompositor (Textual's own compositor if this Textual does not fit)."""

    def __init__(
        self, name: str | None = None, id: str | None = None, classes: str | None = None
    ) -> None:
        super().__init__(name=name, id=id, classes=classes)
        if lean_compositor_fits() and type(getattr(self, "_compositor", None)) is Compositor:
            self._compositor = LeanCompositor()
