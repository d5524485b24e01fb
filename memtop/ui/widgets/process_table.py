"""The process table: NVML's processes joined with the agents, one row per process and GPU.

A line-API widget rather than a DataTable: a DataTable repaints itself whole (and drops its
row caches) on every cell update, and this table changes every second.  Here each row is one
Rich Text, rebuilt from its ProcessRow; only the lines whose text changed are repainted, so
the border and header never go back over the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.geometry import Region, Size
from textual.message import Message
from textual.strip import Strip
from textual.widget import Widget

from memtop.ui.render import FREE, short_bytes
from memtop.ui.view import ProcessRow
from memtop.units import format_bytes


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    cell: Callable[[ProcessRow, bool], str]
    right: bool = False
    compact: bool = True  # shown in the compact layout too


def _bytes(value: int | None, compact: bool) -> str:
    if value is None:
        return "—"
    return short_bytes(value) if compact else format_bytes(value)


def _step(row: ProcessRow, compact: bool) -> str:
    if row.state == "exited":
        return "exited"
    if row.state not in ("agent", "no agent"):
        return row.state
    return "—" if row.step is None else str(row.step)


COLUMNS = (
    Column("pid", "PID", lambda r, c: str(r.pid), right=True),
    Column("user", "USER", lambda r, c: r.user[:10], compact=False),
    Column("gpu", "GPU", lambda r, c: "—" if r.gpu is None else str(r.gpu), right=True),
    Column("used", "USED", lambda r, c: _bytes(r.used, c), right=True),
    Column("allocated", "ALLOC", lambda r, c: _bytes(r.allocated, c), right=True),
    Column("reserved", "RESERVED", lambda r, c: _bytes(r.reserved, c), right=True),
    Column("peak", "PEAK", lambda r, c: _bytes(r.peak, c), right=True),
    Column("step", "STEP", _step, right=True),
    Column("trend", "TREND", lambda r, c: r.trend, compact=False),
    Column("command", "COMMAND", lambda r, c: r.command),
)
GAP = 2  # spaces between columns


class ProcessTable(Widget, can_focus=True):
    """Rows keyed by (pid, GPU): the cursor stays on its process across refreshes."""

    COMPONENT_CLASSES = {
        "process-table--header",
        "process-table--cursor",
        "process-table--cursor-blurred",
    }
    DEFAULT_CSS = """
    ProcessTable > .process-table--header { text-style: bold; color: $text-muted; }
    ProcessTable > .process-table--cursor { background: $accent; color: $text; }
    ProcessTable > .process-table--cursor-blurred { background: $accent 30%; }
    """
    BINDINGS = [
        Binding("up", "move(-1)", "Up", show=False),
        Binding("down", "move(1)", "Down", show=False),
        Binding("pageup", "move(-10)", show=False),
        Binding("pagedown", "move(10)", show=False),
        Binding("home", "move(-1000000)", show=False),
        Binding("end", "move(1000000)", show=False),
        Binding("enter", "choose", "Detail", show=False),
    ]

    class RowChosen(Message):
        """Enter (or a click on the selected row) on a row: open its detail."""

        def __init__(self, row: ProcessRow) -> None:
            super().__init__()
            self.row = row

    def __init__(self) -> None:
        super().__init__(id="processes")
        self.rows: tuple[ProcessRow, ...] = ()
        self.rows_by_key: dict[str, ProcessRow] = {}
        self.cursor_row = 0
        self._top = 0  # first row shown (the table scrolls to keep the cursor in view)
        self._compact = False
        self._lines: list[Text] = []
        self._header = Text()
        self._layout_key: tuple[object, ...] = ()

    def on_mount(self) -> None:
        self.border_title = "Processes"

    # ------------------------------------------------------------------ data

    def show(self, rows: tuple[ProcessRow, ...], compact: bool) -> None:
        selected = self.selected_key()
        self.rows = rows
        self.rows_by_key = {row.key: row for row in rows}
        self._compact = compact
        keys = [row.key for row in rows]
        if selected in self.rows_by_key:
            self.cursor_row = keys.index(selected)
        self.cursor_row = max(0, min(self.cursor_row, len(rows) - 1))
        self._render_rows()

    def _render_rows(self) -> None:
        """Rebuild each row's text; repaint only the lines that differ from what is shown."""
        columns = [c for c in COLUMNS if c.compact or not self._compact]
        cells = [[c.cell(row, self._compact) for c in columns] for row in self.rows]
        widths = [max([len(c.label), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
        room = self.content_region.width - sum(widths[:-1]) - GAP * (len(columns) - 1) - 1
        widths[-1] = max(8, room)
        layout_key = (tuple(widths), self._compact, len(self.rows), self.size)
        header = Text(" ")
        for column, width in zip(columns, widths, strict=True):
            header.append(_fit(column.label, width, column.right) + " " * GAP)
        lines = [
            self._row_text(row, row_cells, columns, widths)
            for row, row_cells in zip(self.rows, cells, strict=True)
        ]
        if layout_key != self._layout_key:
            self._layout_key = layout_key
            self._header, self._lines = header, lines
            self.refresh(layout=True)
            return
        for index, line in enumerate(lines):
            old = self._lines[index]
            if line.plain != old.plain or line.spans != old.spans or line.style != old.style:
                self._lines[index] = line
                self._refresh_row(index)

    def _row_text(
        self, row: ProcessRow, cells: list[str], columns: list[Column], widths: list[int]
    ) -> Text:
        text = Text(" ", style=FREE if row.state == "exited" else "")
        for column, cell, width in zip(columns, cells, widths, strict=True):
            style = ""
            if column.key == "trend" and row.trend:
                style = "bold red"
            elif column.key == "step" and row.state == "exited":
                style = "yellow"
            text.append(_fit(cell, width, column.right), style=style)
            text.append(" " * GAP)
        return text

    # ------------------------------------------------------------------ rendering

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self.rows) + 1

    def render_line(self, y: int) -> Strip:
        width = self.content_region.width
        base = self.rich_style
        if y == 0:
            style = self.get_component_rich_style("process-table--header")
            return _strip(self.app.console, self._header, width, base + style)
        index = self._top + y - 1
        if index >= len(self._lines):
            return Strip.blank(width, base)
        if index == self.cursor_row:
            # Under the row's own styles, so a red trend keeps its colour on the cursor.
            name = "process-table--cursor" if self.has_focus else "process-table--cursor-blurred"
            base = base + self.get_component_rich_style(name)
        return _strip(self.app.console, self._lines[index], width, base)

    def _refresh_row(self, index: int) -> None:
        y = index - self._top + 1
        if 1 <= y < self.size.height:
            self.refresh(Region(0, y, self.size.width, 1))

    def on_resize(self) -> None:
        self._render_rows()

    def on_focus(self) -> None:
        self._refresh_row(self.cursor_row)

    def on_blur(self) -> None:
        self._refresh_row(self.cursor_row)

    # ------------------------------------------------------------------ selection

    def selected_key(self) -> str | None:
        if not self.rows:
            return None
        return self.rows[min(self.cursor_row, len(self.rows) - 1)].key

    def selected(self) -> ProcessRow | None:
        key = self.selected_key()
        return self.rows_by_key.get(key) if key is not None else None

    def get_row_index(self, key: str) -> int:
        return [row.key for row in self.rows].index(key)

    def move_cursor(self, row: int) -> None:
        before = self.cursor_row
        self.cursor_row = max(0, min(row, len(self.rows) - 1))
        visible = max(1, self.size.height - 1)
        top = self._top
        if self.cursor_row < top:
            top = self.cursor_row
        elif self.cursor_row >= top + visible:
            top = self.cursor_row - visible + 1
        if top != self._top:
            self._top = top
            self.refresh()
        else:
            self._refresh_row(before)
            self._refresh_row(self.cursor_row)

    def action_move(self, delta: int) -> None:
        self.move_cursor(self.cursor_row + delta)

    def action_choose(self) -> None:
        row = self.selected()
        if row is not None:
            self.post_message(self.RowChosen(row))

    def on_click(self, event: events.Click) -> None:
        index = self._top + event.y - 1
        if 0 <= index < len(self.rows):
            if index == self.cursor_row and event.chain >= 2:
                self.action_choose()
            self.move_cursor(index)


def _fit(text: str, width: int, right: bool) -> str:
    if len(text) > width:
        return text[: max(0, width - 1)] + "…"
    return text.rjust(width) if right else text.ljust(width)


def _strip(console: Console, text: Text, width: int, style: Style) -> Strip:
    segments = Segment.apply_style(text.render(console, end=""), style=style)
    return Strip(list(segments)).crop_extend(0, width, style)
