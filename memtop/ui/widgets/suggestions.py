"""The suggestions pane: what to do, most severe first, with the evidence and a copyable fix."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from memtop.ui.render import FREE, SEVERITY_STYLES
from memtop.ui.view import SuggestionItem

BADGES = {"emergency": "EMERG", "critical": "CRIT", "warning": "WARN", "info": "INFO"}


def suggestion_text(item: SuggestionItem, compact: bool, width: int | None = None) -> Text:
    """Title line, evidence line, fix line; compact layouts keep each to one row."""
    badge = Text(f" {BADGES.get(item.severity, item.severity.upper()):<5} ")
    badge.stylize(SEVERITY_STYLES.get(item.severity, ""))
    where = []
    if item.pid is not None:
        where.append(f"pid {item.pid}")
    if item.device is not None:
        where.append(f"GPU {item.device}")
    title = Text.assemble(badge, " ", (item.title, "bold"))
    if where:
        title.append(f"  {' · '.join(where)}", style=FREE)
    if item.effect:
        title.append(f"  {item.effect}", style="green")
    lines = [title]
    indent = " " * 8
    if item.evidence:
        lines.append(Text(indent + item.evidence, style=FREE))
    if item.fix:
        lines.append(Text.assemble(indent, ("$ ", FREE), (item.fix, "bold cyan")))
    # One row per line at any width: wrapped evidence would lose its indent and push the next
    # suggestion out of view; the detail screen has the full text.
    if width is not None:
        for line in lines:
            line.truncate(width, overflow="ellipsis")
    if compact and len(lines) > 2 and item.fix:
        lines = [lines[0], lines[-1]]  # 80×24: the title and the fix; evidence is in detail
    return Text("\n").join(lines)


class SuggestionsPane(OptionList):
    """Rebuilt only when the items changed; the highlight follows its item by key."""

    def __init__(self) -> None:
        super().__init__(id="suggestions")
        self.items: tuple[SuggestionItem, ...] = ()
        self._compact: bool | None = None
        self._width = 0

    def on_mount(self) -> None:
        self.border_title = "Suggestions"

    def show(self, items: tuple[SuggestionItem, ...], compact: bool) -> None:
        width = self.scrollable_content_region.width - 1
        if items == self.items and compact == self._compact and width == self._width:
            return
        selected = self.selected()
        self.items = items
        self._compact = compact
        self._width = width
        self.clear_options()
        if not items:
            self.add_option(Option(Text("  Nothing to suggest: memory looks healthy.", FREE)))
            self.border_subtitle = ""
            return
        self.add_options(
            [Option(suggestion_text(item, compact, width), id=item.key) for item in items]
        )
        counts = [
            f"{sum(i.severity == s for i in items)} {s}"
            for s in ("emergency", "critical", "warning", "info")
            if any(i.severity == s for i in items)
        ]
        self.border_subtitle = " · ".join(counts) + "  (y copies the fix)"
        if selected is not None:
            keys = [item.key for item in items]
            if selected.key in keys:
                self.highlighted = keys.index(selected.key)

    def selected(self) -> SuggestionItem | None:
        index = self.highlighted
        if index is None or not self.items or index >= len(self.items):
            return None
        return self.items[index]
