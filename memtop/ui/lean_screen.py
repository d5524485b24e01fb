"""A screen whose partial updates render only the widgets that paint inside the update.

Textual's compositor, for a partial update, takes the box around every dirty region and renders
each visible widget whose *clip* (its container's region) overlaps that box.  A top-level
widget's clip is the whole screen, so the header, the status line, the footer and every
container render in every frame, whatever changed: on the dashboard, where a frame a second
changes eight table cells, that was most of the widgets rendered (bench/tui_cost.py, issue 12).

`LeanCompositor` keeps a widget only when the part of it that shows (its region within its
clip) overlaps the box: exactly the widgets that can paint a cell there, so the frame is the
same.

Its updates (`SpanUpdate`) also write only the cells of each dirty span.  Textual's write the
span's line from the start of the widget that covers it: a table row whose STEP changed went out
from the table's left border to the STEP column, eighty cells for four, to be diffed away again
by memtop.ui.cell_diff.

Rich and Textual remember, each in an LRU of 16,384 entries, how a segment of a line splits at a
cell (`Segment._split_cells`, on every crop and every division of a line into chops) and the
escape sequence of each style (`Strip.render_ansi`).  Their keys are the lines' contents, and a
dashboard's figures change every second: each new figure is a new entry, ~1 KiB each, ~300 a
minute on a dashboard with trainers coming and going, so the caches grew for most of an hour
(0.5-0.7 MB a minute, issue 36) before Rich's cap held them, at ~16 MB.  A frame that finds one
holding more than TEXT_CACHE_ENTRIES empties it (`trim_text_caches`): what is drawn again next
second is cached again at once.

Everything else is Textual's own (`Compositor._get_renders`, `ChopsUpdate`, textual 8.x);
should a later Textual change what this relies on, the screen falls back to Textual's compositor.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

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
    found = []
    for owner, name in ((Segment, "_split_cells"), (Strip, "render_ansi")):
        cached = getattr(vars(owner).get(name), "__func__", None)
        if callable(getattr(cached, "cache_info", None)) and callable(
            getattr(cached, "cache_clear", None)
        ):
            found.append(cached)
    return tuple(found)


TEXT_CACHES = _text_caches()


def trim_text_caches(limit: int = TEXT_CACHE_ENTRIES, caches: Iterable[Any] = TEXT_CACHES) -> None:
    """Empty each of `caches` that holds more than `limit` entries."""
    for cache in caches:
        if cache.cache_info().currsize > limit:
            cache.cache_clear()


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
                if start != x and strip.cell_length != len(strip.text):
                    start = x  # a wide character may straddle x1: from the chop, as Textual does
                if stop <= start:
                    continue
                if start != x or stop != end:
                    strip = strip.crop(start - x, stop - x)
                append(f"\x1b[{y + 1};{start + 1}H")  # Control.move_to's sequence
                append(strip.render(console))
            if y != last_y:
                append("\n")  # as Textual writes it
        return "".join(sequences)


class LeanCompositor(Compositor):
    def render_update(self, *args: Any, **kwargs: Any) -> Any:
        trim_text_caches()  # once a frame: a few calls of cache_info()
        return super().render_update(*args, **kwargs)

    def render_partial_update(self) -> ChopsUpdate | None:
        update = super().render_partial_update()
        if update is None:
            return None
        return SpanUpdate(update.chops, update.spans, update.chop_ends)

    def _get_renders(
        self, crop: Region | None = None
    ) -> Iterable[tuple[Region, Region, list[Strip]]]:
        if crop is None:  # a full frame: every widget, as Textual does it
            yield from super()._get_renders(crop)
            return
        overlaps = crop.overlaps
        intersection = Region.intersection
        for widget, (region, clip) in self.visible_widgets.items():
            shown = intersection(region, clip)
            if not shown.area or not overlaps(shown):
                continue  # paints no cell of the update
            # The lines of the part that shows, in the widget's own coordinates.
            yield (
                region,
                clip,
                widget.render_lines(
                    Region(shown.x - region.x, shown.y - region.y, shown.width, shown.height)
                ),
            )


def lean_compositor_fits() -> bool:
    """Whether this Textual's compositor has what LeanCompositor overrides and reads."""
    return (
        callable(getattr(Compositor, "_get_renders", None))
        and callable(getattr(Compositor, "render_partial_update", None))
        and isinstance(getattr(Compositor, "visible_widgets", None), property)
        and callable(getattr(ChopsUpdate, "render_segments", None))
    )


class LeanScreen(Screen[None]):
    """A Screen with LeanCompositor (Textual's own compositor if this Textual does not fit)."""

    def __init__(
        self, name: str | None = None, id: str | None = None, classes: str | None = None
    ) -> None:
        super().__init__(name=name, id=id, classes=classes)
        if lean_compositor_fits() and type(getattr(self, "_compositor", None)) is Compositor:
            self._compositor = LeanCompositor()
