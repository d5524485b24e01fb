"""The suggestions pane: what to do, most severe first, with the evidence and a copyable fix."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from rich.segment import Segment
from rich.style import Style as RichStyle
from rich.text import Text
from textual.css.styles import RulesMap
from textual.geometry import Region
from textual.strip import Strip
from textual.style import Style as VisualStyle
from textual.visual import RenderOptions, Visual, VisualType, visualize
from textual.widget import Widget
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from memtop.diagnosis.suggestions import EffectKind
from memtop.model import Severity
from memtop.ui.fixes import fix_lines
from memtop.ui.render import FREE, SEVERITY_STYLES, slow_tick
from memtop.ui.renewal import Renewal
from memtop.ui.view import SuggestionItem
from memtop.ui.widgets.lines import cells, changed_cells, looks_alike, text_strip

if TYPE_CHECKING:
    from textual.widgets._option_list import _LineCache

BADGES = {
    Severity.EMERGENCY: "EMERG",
    Severity.CRITICAL: "CRIT",
    Severity.WARNING: "WARN",
    Severity.INFO: "INFO",
}


EFFECT_STYLES = {
    EffectKind.SAVING: "green",
    EffectKind.GROWTH: "bold red",
    EffectKind.EXCESS: "yellow",
    EffectKind.ROOM: "cyan",
}
URGENT = ("critical", "emergency")


def clip(text: Text, width: int) -> Text:
    """One row: cut at a word boundary with an ellipsis, so a figure is never cut in half
    ("488 samples" must not read "488 s…").  Measured by `cells`, not Rich's `cell_len`, whose
    cache keeps every line it measures: a suggestion's lines quote figures that move, so it
    filled with them (issue 35 item 8)."""
    plain = text.plain
    if cells(plain) <= width:
        return text
    cut = plain.rfind(" ", 0, max(1, width - 1))
    if cut < width // 2:  # no space near the end: cut where it falls
        cut = max(0, width - 1)
    clipped = text[:cut]
    clipped.rstrip()
    clipped.append("…", style=FREE)
    return clipped


_ASIDE = re.compile(r" \([^()]*\)")


def fit_title(title: str, room: int) -> str:
    """The title in `room` cells: its asides in parentheses go first, the last first, so the
    figures a reader acts on survive 80 columns ("Leak: +8.0 MiB per step, full in ~49 min",
    not "…(960.0 MiB/min), full in…")."""
    while len(title) > room:
        asides = list(_ASIDE.finditer(title))
        if not asides:
            break
        last = asides[-1]
        title = title[: last.start()] + title[last.end() :]
    return title


def suggestion_text(item: SuggestionItem, compact: bool, width: int | None = None) -> Text:
    """`suggestion_lines` as one Text, a line each."""
    return Text("\n").join(suggestion_lines(item, compact, width))


def suggestion_lines(item: SuggestionItem, compact: bool, width: int | None = None) -> list[Text]:
    """Title line (the pid and GPU first: they must survive any width), then what to do (a
    copyable fix, or for an urgent item with none the prose detail: a leak's culprits), then the
    evidence.  Compact layouts keep two rows: the title and what to do."""
    badge = Text(f" {BADGES.get(item.severity, item.severity.upper()):<5} ")
    badge.stylize(SEVERITY_STYLES.get(item.severity, ""))
    where = []
    if item.pid is not None:
        where.append(f"pid {item.pid}")
    if item.device is not None:
        where.append(f"GPU {item.device}")
    title = Text.assemble(badge, " ")
    if where:
        title.append(" · ".join(where), style="bold")
        title.append("  ")
    words = item.title
    if width is not None:
        words = fit_title(words, width - cells(title.plain))
    title.append(words, style="bold")
    if item.effect:
        title.append(f"  {item.effect}", style=EFFECT_STYLES.get(item.effect_kind, "green"))
    if item.room:
        title.append(" · ", style=FREE)
        title.append(item.room, style=EFFECT_STYLES[EffectKind.ROOM])
    indent = " " * 8
    todo: list[Text] = []
    if item.fix:  # the whole fix, wrapped: what `y` copies is what is read (memtop.ui.fixes)
        todo = fix_lines(item, indent, width)
    elif item.detail and item.severity in URGENT:
        todo = [Text.assemble(indent, ("→ ", FREE), (item.detail, "bold"))]
    evidence = Text(indent + item.evidence, style=FREE) if item.evidence else None
    if compact:
        lines = [title, *(todo or ([evidence] if evidence else []))]
    else:
        lines = [title, *([evidence] if evidence else []), *todo]
    # One row per line at any width (but a fix's, wrapped above): wrapped evidence would lose
    # its indent and push the next suggestion out of view; the detail screen has the full text.
    if width is not None:
        lines = [clip(line, width) for line in lines]
    return lines


# A suggestion's wording carries live figures ("full in ~9 min (5672 steps)"); rewording it
# every second costs a repaint of the pane for news nobody reads that fast.  New, gone or
# re-ranked suggestions show at once; changed figures once per slow period, in the same frame
# as the GPU cards' and the table's slow figures (render.slow_tick): a figure the pane and a
# card both show ("allocated", "cached") is then of one round in both.


def _option_strip(strip: Strip, length: int, y: int, option: int) -> Strip:
    """The strip with the meta Textual's OptionList gives its options' cells: the option's
    index on every cell, and on the text's (up to `length`) each one's place in its line, as
    Textual's content pipeline marks it (its text selection reads it); one style per segment
    made once, rather than the offsets and then the index (Strip.apply_meta) each a pass."""
    segments = []
    x = 0
    index = {"option": option}
    for segment in strip:
        meta = {"offset": (x, y), **index} if x < length else index
        style = (segment.style or RichStyle()) + RichStyle.from_meta(meta)
        segments.append(Segment(segment.text, style))
        x += len(segment.text)
    return Strip(segments, strip.cell_length)


def _fits(prompt: Text, width: int) -> bool:
    """Whether each line of `prompt` fits in `width` cells (none would wrap)."""
    return all(cells(line) <= width for line in prompt.plain.split("\n"))


class LaidOutPrompt(Visual):
    """A suggestion's prompt as the pane lays it out (suggestion_text: one row per line, each
    cut to the pane's width): its height is its number of lines wherever none is wider than
    the width asked about, without Textual's content pipeline, which a new set of suggestions
    ran over every option to measure it (0.2 ms an option, 6 µs here; issue 35 item 8);
    anything else (another width, a rendering) is Textual's own visual of it."""

    def __init__(self, widget: Widget, prompt: Text, lines: list[Text] | None = None) -> None:
        """`lines`: the prompt's lines as they were joined into it (suggestion_lines), if
        known."""
        self._widget = widget
        self._prompt = prompt
        plain = prompt.plain
        self._rows = plain.count("\n") + 1
        # No tab (Textual expands it) and something to draw; else the widest is never "fits".
        fits = bool(plain) and "\t" not in plain
        self._widest = max(cells(line) for line in plain.split("\n")) if fits else None
        self._textual: Visual | None = None
        # (A line holding a newline of its own is more than one row: then split.)
        self._lines = lines if lines is not None and len(lines) == self._rows else None
        # Lines as worded keep each line's own style as its style; split from the whole, as a
        # span: two lines compare alike (looks_alike) only when both are made the same way.
        self.worded = self._lines is not None

    @property
    def prompt(self) -> Text:
        return self._prompt

    @property
    def lines(self) -> list[Text]:
        """The prompt's lines, as worded or else split once: the pane compares them when the
        prompt is reworded and draws them, and splitting a Text is no cheap copy (Text.split:
        its spans divided; most of a reworded suggestion's cost after its wording)."""
        if self._lines is None:
            self._lines = list(self._prompt.split("\n", allow_blank=True))
        return self._lines

    def _content(self) -> Visual:
        if self._textual is None:
            self._textual = visualize(self._widget, self._prompt, markup=False)
        return self._textual

    def render_strips(
        self, width: int, height: int | None, style: VisualStyle, options: RenderOptions
    ) -> list[Strip]:
        return self._content().render_strips(width, height, style, options)

    def get_optimal_width(self, rules: RulesMap, container_width: int) -> int:
        return self._content().get_optimal_width(rules, container_width)

    def get_height(self, rules: RulesMap, width: int) -> int:
        if self._widest is not None and self._widest <= width:
            return self._rows
        return self._content().get_height(rules, width)


class _Placement(NamedTuple):
    """Where a pane's options lie and the width they are drawn at (SuggestionsPane._reword)."""

    lines: _LineCache  # each option's first line and its height
    scroll_y: int
    gutter: int
    width: int  # an option's rows
    plain: bool  # no padding, no selection, a width: options may be drawn through Rich


class SuggestionsPane(OptionList):
    """Rebuilt when the set of suggestions changes; the highlight follows its item by key."""

    _lines_only = False  # inside _update_lines: a new line count is no new layout
    _drawn_width: int | None = None  # inside render_lines: the options' width, lines up to date

    def __init__(self) -> None:
        super().__init__(id="suggestions")
        self.items: tuple[SuggestionItem, ...] = ()
        self._prompts: list[Text] = []  # each item's text as shown
        self._compact: bool | None = None
        self._width = 0
        self._worded_at = -1
        self._quiet = ""  # the line shown when there is nothing to suggest
        # By an option's rendering key: its lines' strips that a rewording left as they were
        # (None: a line reworded), until the option is drawn again (_reword).
        self._kept_strips: dict[tuple[object, ...], list[Strip | None]] = {}

    def on_mount(self) -> None:
        self.border_title = "Suggestions"

    def show(
        self,
        items: tuple[SuggestionItem, ...],
        compact: bool,
        renew: Renewal | bool | None = None,
        quiet: str = "Nothing to suggest: memory looks healthy.",
    ) -> None:
        """`renew`: whether changed figures are worded anew now (the dashboard decides it for
        every widget at once, MemtopApp.refresh_view: a Renewal, for the suggestions about the
        GPUs it names and their processes); None: once per slow period.  New, gone
        or re-ranked suggestions show at once either way.  `quiet`: the line without items."""
        # The gutter is kept whether or not a scrollbar shows: the text's width never changes
        # with the number of items, so lines never re-wrap between refreshes.
        width = self.scrollable_content_region.width - 1
        same_set = [(i.key, i.severity) for i in items] == [(i.key, i.severity) for i in self.items]
        same_set = same_set and (bool(items) or quiet == self._quiet)
        if same_set and compact == self._compact and width == self._width:
            tick = slow_tick()
            if renew is None:
                renew = tick != self._worded_at
            if items == self.items or not renew:
                return
            partial = isinstance(renew, Renewal) and not renew.everything
            if not partial:
                self._worded_at = tick
            kept = list(items)
            reworded: list[tuple[int, Text, list[Text] | None]] = []
            for index, (new, old) in enumerate(zip(items, self.items, strict=True)):
                if new == old:
                    continue
                if partial and not renew.suggestion(new):  # type: ignore[union-attr]
                    kept[index] = old  # as worded: its GPU's figures are held too
                    continue
                # Figures that moved below what the pane prints ("39.5 GiB unused" again)
                # leave the prompt as it is: no re-layout of the list, no repaint.
                lines = suggestion_lines(new, compact, width)
                text = Text("\n").join(lines)
                if not looks_alike(text, self._prompts[index]):
                    self._prompts[index] = text
                    reworded.append((index, text, lines))
            if reworded:
                self._reword(reworded)
            self.items = tuple(kept)
            return
        self._worded_at = slow_tick()
        selected = self.selected()
        self.items = items
        self._compact = compact
        self._width = width
        self._quiet = quiet
        worded: list[list[Text] | None] = [None] * len(items)
        if width > 0:
            worded = [suggestion_lines(item, compact, width) for item in items]
            self._prompts = [Text("\n").join(lines) for lines in worded]  # type: ignore[arg-type]
        else:
            # No width yet: the dashboard's first build runs before Textual's first layout.
            # Worded for none, each line was a "…" (every line fitted and clipped to nothing,
            # CPU the first frame waited for) that `_word_at_width` words again for the width
            # the pane is drawn at, before any line of it is drawn.
            self._prompts = [Text() for _ in items]
        # set_options, not clear_options then add_options: the cleared list's height (0 lines)
        # was a change of the pane's virtual size, and the full one another: each rebuild
        # re-laid the whole screen out and drew it all (a fifth of the dashboard's CPU in the
        # `mixed` demo, where suggestions come and go; bench/tui_cost.py, issue 35).  Now the
        # screen is laid out again only if the pane's number of lines changed.
        self._kept_strips.clear()  # (of options gone with the old set)
        if not items:
            self.set_options([Option(Text(f"  {quiet}", FREE))])
            self.border_subtitle = ""
            return
        self.set_options(
            [
                self._option(text, item.key, lines)
                for text, item, lines in zip(self._prompts, items, worded, strict=True)
            ]
        )
        counts = [
            f"{sum(i.severity == s for i in items)} {s}"
            for s in ("emergency", "critical", "warning", "info")
            if any(i.severity == s for i in items)
        ]
        self.border_subtitle = " · ".join(counts) + "  (tab here: y copies, enter opens)"
        if selected is not None:
            keys = [item.key for item in items]
            if selected.key in keys:
                self.highlighted = keys.index(selected.key)

    def render_lines(self, crop: Region) -> list[Strip]:
        self._word_at_width()
        # The lines brought up to date once for the lines drawn, and the options' width looked
        # up once: Textual's OptionList does both again for every line it draws (its `_lines`
        # updates them; the width is a walk of the CSS gutter and the scrollbars), most of
        # drawing a line of an option already laid out (~105 → ~65 µs a line, frozen
        # dashboard).  Nothing changes the options while they are drawn.
        self._update_lines()
        self._drawn_width = self.scrollable_content_region.width - self._get_left_gutter_width()
        try:
            return super().render_lines(crop)
        finally:
            self._drawn_width = None

    def _word_at_width(self) -> None:
        """The suggestions worded for the width the pane is drawn at, before any line of it is
        drawn (and before Textual's OptionList measures their lines there).  The dashboard's
        first build runs before Textual's first layout, when the pane has no width: its
        suggestions were worded for none, each line a single "…", in the first frame and the
        next ones until the first round after it (MemtopApp.on_ready then worded them again
        once that frame was out, ~40 ms later in a terminal).  A resized terminal's build likewise
        words them for the pane's size before the resize.  Here, at the pane's first drawing
        at a new width, each is worded again in place (its option, its highlight and the
        scroll stay): the frame that shows the pane shows them worded for it, and no other
        frame follows (the whole pane is being drawn: a new width is a new size)."""
        width = self.scrollable_content_region.width - 1
        if width == self._width:
            return
        self._width = width
        if not self.items or self._compact is None:
            return  # (the quiet line is the same at any width)
        for index, item in enumerate(self.items):
            lines = suggestion_lines(item, self._compact, width)
            text = Text("\n").join(lines)
            self._prompts[index] = text
            option = self.get_option_at_index(index)
            option._set_prompt(text)
            option._visual = LaidOutPrompt(self, text, lines)
        # Each option's lines and its height were those of the old wording (none yet, in the
        # first frame: OptionList measures them in its render_lines, next).
        self._option_render_cache.clear()
        self._kept_strips.clear()
        self._line_cache.clear()

    def _update_lines(self) -> None:
        """The pane's height is its box's (1fr in memtop.tcss), never its text's: a new number
        of lines changes only how far it scrolls.  Textual's OptionList asks for a layout of the
        whole screen whenever its line count changes (its `virtual_size` is a layout reactive):
        each suggestion that came or went laid every widget out and redrew the screen, ~10 times
        a minute in the `mixed` demo (15 ms each, most of a new set's cost now that options
        are drawn through Rich; issue 35 item 8).  Here the pane repaints itself alone; the
        screen is laid out again only if its scrollbar appears or goes (its place is the
        compositor's) or the pane's size depends on its content after all (height: auto).
        (c9d3596 did this and was undone when the options' drawing hid what it saves.)"""
        if self._drawn_width is not None:
            return  # up to date: render_lines brought them up to date before drawing
        if self.styles.auto_dimensions:
            super()._update_lines()
            return
        scrollbars = (self.show_vertical_scrollbar, self.show_horizontal_scrollbar)
        self._lines_only = True
        try:
            super()._update_lines()
        finally:
            self._lines_only = False
        if (self.show_vertical_scrollbar, self.show_horizontal_scrollbar) != scrollbars:
            self.refresh(layout=True)
        elif self.scroll_y > self.max_scroll_y:  # fewer lines than the view scrolled past
            self.scroll_to(y=self.max_scroll_y, animate=False, immediate=True)

    def refresh(
        self,
        *regions: Region,
        repaint: bool = True,
        layout: bool = False,
        recompose: bool = False,
    ) -> SuggestionsPane:
        # (Only while _update_lines runs: every other layout request goes through as asked.)
        return super().refresh(
            *regions, repaint=repaint, layout=layout and not self._lines_only, recompose=recompose
        )

    def _option(self, prompt: Text, key: str, lines: list[Text] | None = None) -> Option:
        option = Option(prompt, id=key)
        # What OptionList would visualise lazily.
        option._visual = LaidOutPrompt(self, prompt, lines)
        return option

    def _replace_option_prompt(self, index: int, prompt: VisualType) -> None:
        """Textual's drops every option's rendering when one prompt is replaced, and the repaint
        wrapped and styled every suggestion again through its content pipeline (the pane's
        repaints were a fifth of the dashboard's CPU in the `mixed` demo, whose suggestions
        quote figures that move).  Here only the replaced option's rendering is dropped when
        it keeps its number of lines (so its height, and every other option's place, stay),
        and only its lines are repainted: a whole-pane repaint drew every option's lines, the
        pane's border and its scrollbar again for one prompt's figures (59 repaints in 29 s of
        the mixed demo; issue 35 item 8)."""
        self._reword([(index, prompt, None)])

    def _reword(self, prompts: Sequence[tuple[int, VisualType, list[Text] | None]]) -> None:
        """Each (index, prompt, its lines if known) replaced as `_replace_option_prompt` says,
        with one repaint of the cells that changed in them all.  Where the options lie and how
        wide they are drawn is looked up once for them all, not once an option: each look-up
        walked the screen's map of widgets and brought the list's lines up to date, most of a
        reworded option's cost (several are reworded together each slow period; issue 35
        item 8)."""
        regions: list[Region] = []
        whole = False  # a prompt of another number of lines: the whole pane repaints
        at: _Placement | None = None
        for index, prompt, lines in prompts:
            option = self.get_option_at_index(index)
            old = option.prompt
            if not (isinstance(old, Text) and isinstance(prompt, Text)) or old.plain.count(
                "\n"
            ) != prompt.plain.count("\n"):
                super()._replace_option_prompt(index, prompt)
                if isinstance(prompt, Text):
                    option._visual = LaidOutPrompt(self, prompt, lines)
                whole = True
                continue
            was = option._visual
            option._set_prompt(prompt)
            option._visual = now = LaidOutPrompt(self, prompt, lines)
            cache = self._option_render_cache
            # An LRUCache has keys() but cannot be iterated itself.
            drawn = {key: cache.get(key) for key in cache.keys() if key[0] is option}  # noqa: SIM118
            for key in drawn:
                cache.discard(key)
            kept = self._kept_strips
            if whole:
                kept.clear()
                continue  # (its lines are repainted with the whole pane)
            if at is None:
                at = self._placement()
            if isinstance(was, LaidOutPrompt) and was.prompt is old and was.worded == now.worded:
                old_lines, new_lines = was.lines, now.lines
            else:  # (a prompt set from elsewhere: both split, so that they compare alike)
                old_lines = list(old.split("\n", allow_blank=True))
                new_lines = list(prompt.split("\n", allow_blank=True)) if now.worded else now.lines
            changed, moved = self._changed_regions(index, old_lines, new_lines, now.prompt, at)
            regions += changed
            # Its lines that read as before keep their strips (the same characters in the same
            # places of the same option), kept apart from the options' rendering (which
            # Textual's own drawing reads too): only the lines that changed are drawn again,
            # where a reworded suggestion's one figure made all its lines again.
            kept.update((key, list(made)) for key, made in drawn.items() if made is not None)
            for held in [held for held in kept if held[0] is option]:
                if moved is None or len(kept[held]) != len(new_lines):
                    del kept[held]
                else:
                    for y in moved:
                        kept[held][y] = None
        if regions and not whole:
            self.refresh(*regions)

    def _placement(self) -> _Placement:
        """Where the options lie and the width they are drawn at, as `_changed_regions` reads
        them (the lines brought up to date first, where an option is not measured yet: with
        every option measured, the same suggestions at the same width, there is nothing to
        bring up to date, and Textual's update looked the pane's width up twice to find it)."""
        if len(self._line_cache.heights) < len(self.options):
            self._update_lines()
        gutter = self._get_left_gutter_width()
        width = self.scrollable_content_region.width - gutter  # an option's rows are this wide
        padding = self.get_component_styles("option-list--option").padding
        plain = not padding and self.text_selection is None and width > 0
        return _Placement(self._line_cache, self.scroll_offset.y, gutter, width, plain)

    def _changed_regions(
        self, index: int, old_lines: list[Text], new_lines: list[Text], new: Text, at: _Placement
    ) -> tuple[list[Region], set[int] | None]:
        """Where the option at `index` draws differently now that its prompt's lines
        `old_lines` are `new_lines` (as many; its prompt now `new`), in the pane's content
        coordinates: of each line that changed, the cells that moved (a figure: "5805 steps" →
        "5806 steps"), else the line across the text's width.  Never the scrollbar beside the
        text: ScrollView.refresh_lines marks the lines across the whole content region, the
        scrollbar's column too, and the scrollbar (a widget of its own) drew again for each
        reworded option (39 lines in 30 s of the mixed demo, and ~2 lines of the pane's a round
        that no figure changed; issue 35 item 8).  An option drawn otherwise than a row per line
        of its prompt (Textual's pipeline wrapped it): all its lines, across the text's width.
        With them, the lines (of the option's) that changed; None: all of them."""
        top = at.lines.index_to_line[index] - at.scroll_y
        height = at.lines.heights[index]
        gutter, width = at.gutter, at.width
        option = self.get_option_at_index(index)
        if not (
            at.plain
            and self._drawn_here(option, width, None)
            and _fits(new, width)
            and len(new_lines) == height
        ):
            return [Region(gutter, top, max(0, width), height)], None
        regions = []
        moved = set()
        for y, (before, after) in enumerate(zip(old_lines, new_lines, strict=True)):
            if looks_alike(before, after):
                continue
            x0, x1 = changed_cells(before, after) or (0, width)
            regions.append(Region(gutter + x0, top + y, min(x1, width) - x0, 1))
            moved.add(y)
        return regions, moved

    def _drawn_here(self, option: Option, width: int, padding: object) -> bool:
        """Whether `_get_option_render` draws the option itself (a row per line of its prompt,
        each character where it stands in its line, where the lines `_fits`), not Textual's
        content pipeline (a tab, a selection, padding, a divider).  `padding` None: the pane's
        (no padding, no selection, a width) already known to allow it."""
        prompt = option.prompt
        pane = padding is None or (not padding and self.text_selection is None and width > 0)
        return (
            isinstance(prompt, Text) and pane and not option._divider and "\t" not in prompt.plain
        )

    def _get_option_render(self, option: Option, style: VisualStyle) -> list[Strip]:
        """An option's lines through Rich only (memtop.ui.widgets.lines), as the GPU cards'
        and the table's are.  Textual's content pipeline (visualise, wrap, style, strips) cost
        0.44 ms an option (0.17 ms here, on the frozen dashboard), and every option whose
        figures moved is drawn again each slow period, every one after a suggestion comes or
        goes (issue 35 item 8).  The prompts are laid out here, each line cut to the pane's
        width (suggestion_text), so nothing wraps and the strips are those Textual makes;
        anything else (a line that would wrap, a tab, a selection, padding, a divider) goes
        through Textual's own."""
        prompt = option.prompt
        padding = self.get_component_styles("option-list--option").padding
        width = self._drawn_width
        if width is None:  # (an option drawn on its own, not by render_lines)
            width = self.scrollable_content_region.width - self._get_left_gutter_width()
        if not self._drawn_here(option, width, padding):
            return super()._get_option_render(option, style)
        assert isinstance(prompt, Text)
        cache_key = (option, style, padding)
        if (strips := self._option_render_cache.get(cache_key)) is None:
            if not _fits(prompt, width):  # a line would wrap
                return super()._get_option_render(option, style)
            visual = option._visual
            if isinstance(visual, LaidOutPrompt) and visual.prompt is prompt:
                lines = visual.lines
            else:
                lines = list(prompt.split("\n", allow_blank=True))
            base = style.rich_style
            index = self._option_to_index[option]
            console = self.app.console
            # The lines a rewording left as they were, drawn already (None: drawn here).
            kept = self._kept_strips.pop(cache_key, None) or [None] * len(lines)
            strips = [
                strip
                if (strip := kept[y]) is not None
                else _option_strip(
                    text_strip(console, line, width, base), len(line.plain), y, index
                )
                for y, line in enumerate(lines)
            ]
            self._option_render_cache[cache_key] = strips
        return strips

    def on_focus(self) -> None:
        # Tab here lands on the first suggestion, so y and enter act at once (nothing was
        # highlighted until ↓, and enter did nothing).
        if self.highlighted is None and self.items:
            self.highlighted = 0

    def selected(self) -> SuggestionItem | None:
        index = self.highlighted
        if index is None or not self.items or index >= len(self.items):
            return None
        return self.items[index]
