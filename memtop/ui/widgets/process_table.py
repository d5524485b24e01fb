"""The process table: NVML's processes joined with the agents, one row per process and GPU."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rich.text import Text
from textual.widgets import DataTable
from textual.widgets.data_table import CellDoesNotExist, RowDoesNotExist

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


def _command(row: ProcessRow, compact: bool) -> str:
    return row.command


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
    Column("command", "COMMAND", _command),
)


class ProcessTable(DataTable[Text]):
    """Rows are keyed by (pid, GPU), so the cursor stays on its process across refreshes and
    only cells whose text changed are touched."""

    def __init__(self) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, id="processes")
        self.rows_by_key: dict[str, ProcessRow] = {}
        self._compact: bool | None = None
        self._columns: tuple[Column, ...] = ()
        self._command_room = 40

    def on_mount(self) -> None:
        self.border_title = "Processes"

    def show(self, rows: tuple[ProcessRow, ...], compact: bool) -> None:
        if compact != self._compact:
            self._rebuild(compact)
        room = self._room_for_command()
        if room != self._command_room:
            self._command_room = room
            for key, old in self.rows_by_key.items():
                self.update_cell(key, "command", self._cells(old)[-1], update_width=True)
        selected = self.selected_key()
        wanted = {row.key: row for row in rows}
        for key in list(self.rows_by_key):
            if key not in wanted:
                del self.rows_by_key[key]
                self.remove_row(key)
        order_changed = False
        for row in rows:
            previous = self.rows_by_key.get(row.key)
            if previous is None:
                self.add_row(*self._cells(row), key=row.key)
                order_changed = True
            elif previous != row:
                for column, new_cell, old_cell in zip(
                    self._columns, self._cells(row), self._cells(previous), strict=True
                ):
                    if not _same(new_cell, old_cell):
                        self.update_cell(row.key, column.key, new_cell, update_width=True)
            self.rows_by_key[row.key] = row
        if order_changed:
            self.sort("gpu", "pid", key=lambda cells: (_num(cells[0]), _num(cells[1])))
        if selected is not None and selected in self.rows_by_key:
            self._move_to(selected)

    def _rebuild(self, compact: bool) -> None:
        selected = self.selected_key()
        self._compact = compact
        self._columns = tuple(c for c in COLUMNS if c.compact or not compact)
        self.clear(columns=True)
        for column in self._columns:
            self.add_column(column.label, key=column.key)
        for row in self.rows_by_key.values():
            self.add_row(*self._cells(row), key=row.key)
        if selected is not None and selected in self.rows_by_key:
            self._move_to(selected)

    def _room_for_command(self) -> int:
        """What the other columns leave of the table's width (the command is cut to it rather
        than scrolling the table sideways)."""
        others = sum(
            column.get_render_width(self)
            for key, column in self.columns.items()
            if key.value != "command"
        )
        return max(12, self.scrollable_content_region.width - others - 2)

    def _cells(self, row: ProcessRow) -> list[Text]:
        style = FREE if row.state == "exited" else ""
        compact = bool(self._compact)
        cells = []
        for column in self._columns:
            text = Text(column.cell(row, compact), style=style)
            if column.key == "command":
                text.truncate(self._command_room, overflow="ellipsis")
            if column.right:
                text.justify = "right"
            if column.key == "trend" and row.trend:
                text.stylize("bold red")
            if column.key == "step" and row.state == "exited":
                text.stylize("yellow")
            cells.append(text)
        return cells

    def selected_key(self) -> str | None:
        if not self.row_count:
            return None
        try:
            key = self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
        except (CellDoesNotExist, RowDoesNotExist):
            return None
        return key

    def selected(self) -> ProcessRow | None:
        key = self.selected_key()
        return self.rows_by_key.get(key) if key is not None else None

    def _move_to(self, key: str) -> None:
        try:
            index = self.get_row_index(key)
        except RowDoesNotExist:
            return
        if index != self.cursor_row:
            self.move_cursor(row=index, animate=False)


def _num(cell: Text) -> int:
    plain = cell.plain
    return int(plain) if plain.isdigit() else 1 << 30


def _same(a: Text, b: Text) -> bool:
    # Text equality ignores the base style, which marks an exited process.
    return a.plain == b.plain and a.style == b.style and a.spans == b.spans
