"""The per-GPU panel: one card per GPU with its memory bar, numbers, fragmentation and trend."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from operator import attrgetter

from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.geometry import Region
from textual.message import Message
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Static

from memtop.figures.units import format_bytes
from memtop.ui import actions
from memtop.ui.render import (
    ALLOCATED,
    CACHED,
    FREE,
    OTHER,
    PEAK,
    BarEdges,
    fragmentation_style,
    memory_bar,
    short_bytes,
    slow_tick,
    sparkline,
    usage_style,
)
from memtop.ui.renewal import Renewal
from memtop.ui.view import GpuRow
from memtop.ui.widgets.lines import LineText, changed_cells, cut, looks_alike, text_strip

# Below this width the second line uses short sizes (30.2G), so the trend keeps its room.
WIDE_NUMBERS = 136
SLOW_FIELDS = (
    "allocated",
    "fragmentation",
    "trend",
    "utilization",
    "temperature",
    "power_watts",
)

LEGEND = Text.assemble(
    ("█", ALLOCATED),
    " allocated ",
    ("█", CACHED),
    " cached ",
    ("█", OTHER),
    " other (outside PyTorch) ",
    ("┃", PEAK),
    " Σ peaks",  # the card's peak is the sum of its processes' true (torch) peaks
)

# The figures a card shows as soon as they move: every field but the slow ones.
_fast_figures = attrgetter(*(f.name for f in fields(GpuRow) if f.name not in SLOW_FIELDS))


def _changed_region(y: int, old: Text, new: Text, width: int) -> Region:
    """Line `y`'s cells that draw differently (the whole line unless characters moved in
    place)."""
    span = changed_cells(old, new)
    x0, x1 = span if span is not None else (0, width)
    return Region(x0, y, max(1, min(x1, width) - x0), 1)


class GpuCard(Widget, can_focus=True):
    """Two lines for one GPU.  It repaints only when its row changed (rows compare by value).
    Focused (tab) and chosen with enter or a click, it opens the GPU's own detail."""

    DEFAULT_CSS = """
    GpuCard { height: 2; }
    GpuCard.-dense { height: 1; }
    GpuCard:focus { background: $boost; }
    """
    BINDINGS = actions.bindings(actions.GPU_CARD)

    class Chosen(Message):
        """Enter (or a click) on a GPU's card: open its detail."""

        def __init__(self, uuid: str) -> None:
            super().__init__()
            self.uuid = uuid

    def action_choose(self) -> None:
        self.post_message(self.Chosen(self.row.uuid))

    def on_click(self) -> None:
        self.post_message(self.Chosen(self.row.uuid))

    def __init__(self, row: GpuRow, dense: bool = False) -> None:
        # `dense` as a class from the start: added once made, it styled the card before its
        # mount styled it again (each of the dashboard's first cards twice before its first frame).
        super().__init__(classes="-dense" if dense else None)
        self.row = row
        self._slow_tick = -1
        self._strips: list[Strip] | None = None  # the lines as drawn, until the row changes
        self._strips_width = 0
        # The lines of `row` as Text, and the width they were laid out for (-1: lay them out
        # again); made once per change, whether `show` or a repaint needs them first.
        self._lines: list[Text] = []
        self._lines_width = -1
        self._lines_row = row
        self._blank = Strip.blank(0)
        self._base: Style | None = None  # the card's own style, until its CSS changes
        self._bar_edges = BarEdges()  # where the bar's edges were drawn: held across a wobble

    def show(self, row: GpuRow, renew: bool | None = None) -> None:
        """Repaint when something a user must see at once changed (used memory, an error, a
        leak verdict); figures that move every second without news (a sawtooth's allocated
        bytes, the trend sparkline, the smoothed gauge, utilisation, temperature, power) are
        shown anew once per slow period (render.slow_tick), all cards in the same frame.
        Each repaint costs CPU and bytes over SSH.  `renew`: whether the slow figures are shown
        anew now; the dashboard decides it for every widget at once (MemtopApp.refresh_view),
        None decides it here (a new slow period, or a leak verdict that changed)."""
        tick = slow_tick()
        if renew is None:
            renew = tick != self._slow_tick or row.trend.leak != self.row.trend.leak
        if not renew:
            if _fast_figures(row) == _fast_figures(self.row):
                return  # the common round: nothing to show at once (no copy of the row made)
            row = replace(row, **{name: getattr(self.row, name) for name in SLOW_FIELDS})
        else:
            self._slow_tick = tick
        if row == self.row:
            return
        self.row = row
        if self._strips is None:
            self.refresh()  # not drawn yet, or all of it again: laid out where it is drawn
            return
        # Compared with what is drawn, at the width it was drawn at (render_line lays the card
        # out again at another): its width is not looked up here, a walk to the screen's map
        # of widgets (Widget.size) that a card did for its layout, again for its lines and
        # again for each region it marked (a fifth of the cards' showing; issue 35 item 8).
        width = self._strips_width
        drawn = self._lines if self._lines_width == width else None
        lines = self._laid_out(width)
        if drawn is None or len(lines) != len(drawn):
            self._strips = None  # drawn otherwise: all of it
            self.refresh()
            return
        # A figure that moved below what the card prints (38.71 → 38.74 GiB, a flat sparkline's
        # floor) leaves the same characters: no repaint, no frame, no bytes.  Otherwise only the
        # cells that moved (a sparkline, a gauge's figure) are repainted, not whole lines: every
        # card changes in the same frame each slow period.
        regions = [
            _changed_region(y, old, new, width)
            for y, (old, new) in enumerate(zip(drawn, lines, strict=True))
            if not looks_alike(old, new)
        ]
        if regions:
            self._strips = None
            self.refresh(*regions)

    def notify_style_update(self) -> None:
        self._strips = None  # the CSS changed (theme, -dense): draw again
        self._base = None
        self._lines_width = -1
        super().notify_style_update()

    def render_line(self, y: int) -> Strip:
        """A line of `render()`, through Rich only (memtop.ui.widgets.lines): Textual's
        content pipeline cost ~1 ms a card, and all cards repaint together each slow period."""
        width = self.size.width
        if self._strips is None or self._strips_width != width:
            # The card's own style (its colours over its ancestors') kept until its CSS changes,
            # as the strips drawn in it are: DOMNode.rich_style walks every ancestor's styles,
            # a third of drawing a card's line again (issue 35 item 8).
            base = self._base
            if base is None:
                base = self._base = self.rich_style
            lines = self._laid_out(width)
            self._strips = [text_strip(self.app.console, line, width, base) for line in lines]
            self._strips_width = width
            self._blank = Strip.blank(width, base)
        return self._strips[y] if y < len(self._strips) else self._blank

    def _laid_out(self, width: int) -> list[Text]:
        """The card's lines for the current row at `width` (made again only after a change)."""
        if self._lines_width != width or self._lines_row is not self.row:
            self._lines = self._lay_out(width)
            self._lines_width = width
            self._lines_row = self.row
        return self._lines

    def render(self) -> Text:
        return Text("\n").join(self._lay_out(self.size.width))

    def _lay_out(self, width: int) -> list[Text]:
        """The card's lines, each its own Text (not one Text of both, split again)."""
        compact = width < 100
        first = self._first_line(width, compact)
        if self.has_class("-dense"):
            return [first]
        return [first, self._second_line(width, compact)]

    def _first_line(self, width: int, compact: bool) -> Text:
        row = self.row
        dense = self.has_class("-dense")
        label = f"GPU{row.index} " if compact else f"GPU {row.index}  {row.name[:26]} "
        if row.mig:  # a MIG instance, on the row under its GPU's: "GPU 0 · MIG 3g.40gb #1"
            gpu_instance = row.mig.rsplit("#", 1)[-1]
            label = (
                f"GPU{row.index}:{gpu_instance} " if compact else f"GPU {row.index} · {row.mig} "
            )
        if compact and row.host:  # the fleet: the card without its name still names its host
            label = f"GPU{row.index} {row.host} "
        if row.error and row.used is None:
            return Text(label, style="bold").append(Text(row.error, style="bold red"))
        # Each piece is added to the line's pieces (LineText), never `a + b`: that copies `a`
        # whole (its text cleaned of control codes again, its spans copied) for each piece,
        # and the cards are laid out again together each slow period.  The same text and
        # spans as the sums, the bold head the line's own style.
        head = LineText().add(label)
        share = row.used_share
        if compact:
            numbers = f" {short_bytes(row.used)}/{short_bytes(row.total)}"
        else:
            numbers = f" {format_bytes(row.used)} / {format_bytes(row.total)}"
        pct = f" {100 * share:5.1f} %" if share is not None else "    — "
        tail = LineText().add(numbers).add(pct, usage_style(share))
        if (compact or dense) and row.agents:
            tail.add_text(self._fragmentation(" "))
        if dense:
            # One line: a leak's pid and time to full, not its sparkline, must fit 80 columns.
            tail.add(" ").add_text(self._trend(28, short=True, spark=not row.trend.leak))
        bar_width = max(8, width - len(head) - len(tail) - 2)
        bar = memory_bar(
            bar_width,
            row.total,
            row.allocated,
            row.reserved,
            row.other,
            row.peak,
            row.used,
            self._bar_edges,
        )
        line = head.add("▕", FREE).add_text(bar).add("▏", FREE).add_text(tail)
        if row.error:
            line.add(f"  {row.error}", "red")
        return cut(line.text("bold"), width)

    def _second_line(self, width: int, compact: bool) -> Text:
        row = self.row
        indent = "     " if compact else "        "
        trend_min = 9 + len(row.trend.label())
        device = self._device()
        if row.agents:
            if compact or width < WIDE_NUMBERS + len(device):
                line = self._numbers(indent, short_bytes, " ", with_fragmentation=not compact)
            else:
                line = self._numbers(indent, format_bytes, "  ", with_fragmentation=not compact)
        else:
            processes = f"{row.processes} process{'es' if row.processes != 1 else ''}"
            line = Text(f"{indent}{processes}, no PyTorch agent", style=FREE)
        if device and not compact:
            line = Text.assemble(line, " ", device)
        room = width - len(line) - 2
        if room >= 10:
            line.append("  ").append(self._trend(room, short=room < trend_min).text())
        return cut(line, width)

    def _numbers(
        self, indent: str, fmt: Callable[[int | None], str], gap: str, with_fragmentation: bool
    ) -> Text:
        row = self.row
        line = Text(indent)
        for name, value in (
            ("alloc " if fmt is short_bytes else "allocated ", row.allocated),
            ("rsvd " if fmt is short_bytes else "reserved ", row.reserved),
            ("other ", row.other),
            ("Σpeak ", row.peak),
        ):
            line.append(name, style=FREE)
            line.append(fmt(value) + gap)
        if with_fragmentation:
            line.append(self._fragmentation("").text())
        return line

    def _fragmentation(self, lead: str) -> LineText:
        frag = self.row.fragmentation
        style = fragmentation_style(frag)
        if style == "bold red" and not self.row.fragmentation_flagged:
            style = "yellow"  # red only with a suggestion saying it is worth fixing
        return (
            LineText()
            .add(f"{lead}frag ", FREE)
            .add(f"{frag:.2f}" if frag is not None else "—", style)
        )

    def _device(self) -> Text:
        """Utilisation, temperature, power: fixed widths, so the line never shifts."""
        row = self.row
        if row.utilization is None and row.temperature is None and row.power_watts is None:
            return Text()
        util = f"{row.utilization:3d}%" if row.utilization is not None else "  —"
        temp = f"{row.temperature:3d}°C" if row.temperature is not None else "   —"
        power = f"{row.power_watts:4.0f}W" if row.power_watts is not None else "    —"
        hot = row.temperature is not None and row.temperature >= 85
        return Text.assemble(
            ("util ", FREE), util, " ", (temp, "bold red" if hot else ""), " ", power
        )

    def _trend(self, room: int, short: bool, spark: bool = True) -> LineText:
        trend = self.row.trend
        label = trend.label(short)
        text = LineText()
        if spark and room - len(label) - 1 >= 6:  # else the label alone: it is the news
            spark_width = min(32, room - len(label) - 1)
            style = "bold red" if trend.leak else ("cyan" if trend.values else FREE)
            text.add(sparkline(trend.values, spark_width, trend.floor, trend.span), style)
            text.add(" ")
        return text.add(label, "bold red" if trend.leak else FREE)


WAITING = "Reading devices and agents…"


class GpuPanel(VerticalScroll):
    """Cards keyed by GPU UUID; cards are added and removed as GPUs come and go."""

    DEFAULT_CSS = """
    GpuPanel { height: auto; max-height: 50%; }
    """

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self._cards: dict[str, GpuCard] = {}  # by GPU UUID
        self._waiting: Static | None = Static(WAITING, id="gpu-waiting", classes="muted")
        self._said = WAITING  # the line shown while there is no card

    def compose(self) -> ComposeResult:
        if self._waiting is not None:
            yield self._waiting

    def on_mount(self) -> None:
        self.border_title = "GPUs"
        self.border_subtitle = LEGEND

    def show(
        self,
        gpus: tuple[GpuRow, ...],
        dense: bool,
        renew: Renewal | bool | None = None,
        no_gpus: str | None = None,
    ) -> None:
        """`renew`: as SuggestionsPane.show (a Renewal: the cards of the GPUs it names).
        `no_gpus`: why there is no card (no driver, no such GPU), said in place of the
        "Reading…" line, which otherwise stayed forever on a machine without NVML."""
        if gpus and self._waiting is not None:
            self._waiting.remove()
            self._waiting = None
        elif not gpus:
            line = no_gpus or WAITING
            if self._waiting is None:
                # Why there is no GPU, as a driver or a fleet source said it: words, not markup.
                self._waiting = Static(Text(line), id="gpu-waiting", classes="muted")
                self.mount(self._waiting)
            elif self._said != line:
                self._waiting.update(Text(line))
            self._said = line
        wanted = {row.uuid for row in gpus}
        for uuid in [uuid for uuid in self._cards if uuid not in wanted]:
            self._cards.pop(uuid).remove()
        new: list[GpuCard] = []
        for row in gpus:
            card = self._cards.get(row.uuid)
            if card is None:
                card = self._cards[row.uuid] = GpuCard(row, dense)
                new.append(card)
                continue
            card.show(row, renew.gpu(row) if isinstance(renew, Renewal) else renew)
            if card.has_class("-dense") != dense:  # (set_class checks its names each call)
                card.set_class(dense, "-dense")
        if new:
            self.mount_all(new)
