"""The process table: NVML's processes joined with the agents, one row per process and GPU.

A line-API widget rather than a DataTable: a DataTable repaints itself whole (and drops its
row caches) on every cell update, and this table changes every second.  Here each row's line is
its characters and the names of its styles, laid out from its ProcessRow when what its cells
show moved (its STEP, which moves on every row, set into it) and drawn straight into Textual's
segments (no Rich Text per row), framed by the border Textual drew once (framed_lines); only the
lines that changed are repainted, so the border and header never go back over the wire.
Columns have fixed widths (a value that grows never shifts its neighbours).

What htop and nvitop users expect: sort by any column (`<` `>` move the sort column, `I`
inverts, a click on a header sorts by it), a filter (`/`), and the ranks of a torchrun job
grouped under their launcher with the spread between them; in the fleet view, the ranks of one
job across hosts grouped under that job (view.JobHeader).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import fields as record_fields
from dataclasses import replace
from operator import attrgetter
from typing import Any

from rich.style import Style
from rich.text import Text
from textual import events
from textual.geometry import Region, Size
from textual.message import Message
from textual.strip import Strip
from textual.widget import Widget

from memtop.base.records import record
from memtop.ui import actions
from memtop.ui.render import FREE, short_bytes, slow_tick
from memtop.ui.renewal import Renewal
from memtop.ui.view import JobHeader, ProcessRow, process_key
from memtop.ui.widgets.framed_lines import FramedLinesCache
from memtop.ui.widgets.lines import (
    changed_cells,
    looks_alike,
    moved_cells,
    pieces_strip,
    text_strip,
)


@record(frozen=True)
class Column:
    """One column of the process table: its label, cell, widths, alignment and sort."""

    key: str
    label: str
    cell: Callable[[ProcessRow, bool], str]
    width: tuple[int, int]  # (full, compact); 0 = not shown in that layout
    right: bool = False
    sort: Callable[[ProcessRow], object] | None = None
    descending: bool = False  # the natural order of a sort by this column (sizes: largest first)


def _bytes(value: int | None, compact: bool, last_known: bool = False) -> str:
    if value is None:
        return "—"
    text = short_bytes(value)
    return "~" + text if last_known else text  # an exited process: the last value seen


def _mem(name: str) -> Callable[[ProcessRow, bool], str]:
    return lambda r, c: _bytes(getattr(r, name), c, r.last_known)


def _step(row: ProcessRow, compact: bool) -> str:
    if row.state == "exited":
        return "exited"
    if row.state not in ("agent", "no agent"):
        return row.state[:7]
    return "—" if row.step is None else str(row.step)


def _cpu(row: ProcessRow, compact: bool) -> str:
    return "—" if row.cpu_percent is None or row.last_known else f"{row.cpu_percent:.0f}"


def _rss(row: ProcessRow, compact: bool) -> str:
    return "—" if row.rss is None or row.last_known else short_bytes(row.rss)


def _runtime(row: ProcessRow, compact: bool) -> str:
    if row.run_seconds is None:
        return "—"
    seconds = int(row.run_seconds)
    # Whole minutes: a column that changed every second would repaint every row every second.
    hours, rest = divmod(seconds // 60, 60)
    return f"{hours}h{rest:02d}m" if hours else f"{rest}m"


def _command(row: ProcessRow, compact: bool) -> str:
    command = row.command if row.rocm is None else f"ROCm {row.command}"  # on AMD GPUs
    command = command if row.rank is None else f"r{row.rank} {command}"
    # The fleet: the compact layout has no USER column, where a remote row names its host.
    return f"{row.host}: {command}" if compact and row.host else command


def _num(value: float | None) -> float:
    return float("-inf") if value is None else value


COLUMNS = (
    Column("pid", "PID", lambda r, c: str(r.pid), (7, 7), True, lambda r: r.pid),
    Column("user", "USER", lambda r, c: r.user[:8], (8, 0), sort=lambda r: r.user),
    Column(
        "gpu",
        "GPU",
        lambda r, c: r.gpu_label,
        (3, 3),
        True,
        lambda r: _num(r.gpu),
    ),
    Column("used", "USED", _mem("used"), (6, 6), True, lambda r: _num(r.used), True),
    Column(
        "allocated", "ALLOC", _mem("allocated"), (6, 6), True, lambda r: _num(r.allocated), True
    ),
    Column(
        "reserved", "RESERVED", _mem("reserved"), (8, 6), True, lambda r: _num(r.reserved), True
    ),
    Column("peak", "PEAK", _mem("peak"), (6, 6), True, lambda r: _num(r.peak), True),
    Column("cpu", "CPU%", _cpu, (4, 0), True, lambda r: _num(r.cpu_percent), True),
    Column("rss", "RSS", _rss, (6, 0), True, lambda r: _num(r.rss), True),
    Column("time", "TIME", _runtime, (6, 0), True, lambda r: _num(r.run_seconds), True),
    Column("step", "STEP", _step, (7, 6), True, lambda r: _num(r.step), True),
    Column(
        "trend", "TREND", lambda r, c: r.trend, (11, 10), sort=lambda r: r.trend, descending=True
    ),
    Column("command", "COMMAND", _command, (0, 0), sort=lambda r: r.command),
)
SORTABLE = tuple(c.key for c in COLUMNS)
GAP = 1  # between columns, as htop: every column's width already pads its figures
# Slow columns: figures that move every second without news (a sawtooth's allocated bytes,
# host CPU and RSS) are shown anew once per slow period (render.slow_tick); the rest at once.
# Each repaint of a row is bytes over SSH.
SLOW_FIELDS = ("allocated", "cpu_percent", "rss")
# STEP is how a user sees, at a glance, that a trainer is alive (and that a hostile agent has
# not frozen the view), so it is not a slow column; but it moves on every row every round, and
# at 1 s it was a third of the bytes the dashboard sent in the `mixed` demo (11 agents;
# bench/tty_where.py, issue 35 item 8).  It is shown anew every STEP_S, nvitop's own refresh
# (half a slow period: every other time in the slow period's frame): a counter that moves by
# ten every two seconds says "alive" as well as one that moves by five every second.  A state
# that changes (exited, stalled) shows at once: `_hold` keeps nothing across one.
STEP_FIELDS = ("step",)
STEP_S = 2.0

# Where the command would get fewer than COMMAND_ROOM cells, these go first (in this order).
DROPPABLE = ("time", "rss", "cpu", "user")
COMMAND_ROOM = 24
COMPACT_LABELS = {"reserved": "RSVD"}


@record(frozen=True)
class Group:
    """The header line of a torchrun job: its launcher and the spread between its ranks."""

    launcher: int
    rows: tuple[ProcessRow, ...]

    def text(self) -> Text:
        ranks = [r for r in self.rows if r.allocated is not None]
        world = next((r.world_size for r in self.rows if r.world_size), len(self.rows))
        text = Text(" ▾ ", style="bold")
        text.append(f"launcher pid {self.launcher}", style="bold")
        text.append(f"  {len(self.rows)} of {world} ranks", style=FREE)
        if len(ranks) >= 2:
            top = max(ranks, key=lambda r: r.allocated or 0)
            low = min((r for r in ranks if r is not top), key=lambda r: r.allocated or 0)
            spread = (top.allocated or 0) - (low.allocated or 0)
            text.append("  alloc spread ", style=FREE)
            text.append(short_bytes(spread), style="bold")
            text.append(f" (r{top.rank} − r{low.rank})", style=FREE)
        leaking = sorted((r for r in self.rows if r.trend), key=lambda r: r.last_known)
        if leaking:
            rank = leaking[0]  # a live leak before the last one seen of a rank that exited
            verb = "leaked" if rank.last_known else "leaks"
            trend = rank.trend.removeprefix("was ")
            text.append(f"  r{rank.rank} {verb} {trend}", style="bold red")
        return text


@record(frozen=True)
class JobLine:
    """The header line of one job's ranks across hosts (the fleet view): its label, how many
    of its ranks are shown, its hosts, the spread of the ranks' peaks and the rank that drifts
    or leaks, as memtop.engine.job_groups judged them.  Each rank's row below names its host."""

    job: JobHeader
    rows: tuple[ProcessRow, ...]

    def text(self) -> Text:
        job = self.job
        shown = len({r.pid for r in self.rows})
        world = job.world_size or next(
            (r.world_size for r in self.rows if r.world_size), len(job.members)
        )
        hosts = len(job.hosts)
        text = Text(" ▾ ", style="bold")
        text.append(job.label, style="bold")
        text.append(f"  {shown} of {world} ranks", style=FREE)
        text.append(f" on {hosts} host{'s' if hosts != 1 else ''}", style=FREE)
        # Most telling first: at 80 columns the line's end is cut.
        if job.leaking:
            text.append(f"  {job.leaking}", style="bold red")
        if job.drifting:
            text.append(f"  {job.drifting}", style="bold yellow")
        if job.spread is not None:
            text.append("  peak spread ", style=FREE)
            text.append(short_bytes(job.spread), style="bold")
        if hosts <= 4:  # the names last: each rank's row names its host anyway
            text.append(f"  ({', '.join(job.hosts)})", style=FREE)
        return text


Line = ProcessRow | Group | JobLine

# A row's look: the names of its styles (the row's own, under its STEP cell, under its TREND
# cell; "" for none), what its line is drawn in besides its characters.
RowLook = tuple[str, str, str]
# A line as drawn: a row's characters and look (laid out by the table itself: no Rich Text made
# for it each round), a group's header as Rich Text (a few a screen, in styled words).
Drawn = tuple[str, RowLook] | Text
# The row's cells whose look is their own (the row's `RowLook` after its own style).
STYLED = ("step", "trend")
# A row laid out: its characters before its STEP cell, those after it, its look.
RowParts = tuple[str, str, RowLook]
# The fields of a row its line is kept by: every field the record compares (those held by
# reference, its agent and the like, are not shown), but its STEP, which is set into the line
# laid out around it, and its run time, whose TIME cell is kept by the minute (`_runtime`).  A
# row whose fields these are is drawn as last round but for its STEP.  Derived from the record
# rather than listed: a field added to ProcessRow is counted until it is named here, so a new
# cell can never show last round's figure (tests/test_ui_cost.py changes each field in turn).
_NOT_IN_LINE_KEY = ("step", "run_seconds")
LINE_FIELDS = tuple(
    f.name for f in record_fields(ProcessRow) if f.compare and f.name not in _NOT_IN_LINE_KEY
)
_line_fields = attrgetter(*LINE_FIELDS)


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
    # Its keys are records of memtop.ui.actions (the help screen and the README read them too).
    BINDINGS = actions.bindings(actions.TABLE)

    class RowChosen(Message):
        """Enter (or a click on the selected row) on a row: open its detail."""

        def __init__(self, row: ProcessRow) -> None:
            super().__init__()
            self.row = row

    def __init__(self) -> None:
        super().__init__(id="processes")
        # Each row's line put in the table's border and padding as Textual would, without
        # Textual working that frame out again for every line (widgets.framed_lines).
        self._framed_lines = FramedLinesCache()
        self._styles_cache = self._framed_lines
        self.source: tuple[ProcessRow, ...] = ()  # as the observation lists them
        self.jobs: tuple[JobHeader, ...] = ()  # the fleet view's jobs across hosts
        self.rows: tuple[ProcessRow, ...] = ()  # shown, in display order (cursor moves here)
        self.rows_by_key: dict[str, ProcessRow] = {}
        self.lines: list[Line] = []  # rows and group headers as drawn
        self.cursor_row = 0
        self.sort_key: str | None = None  # None: the observation's order (GPU, then pid)
        self.sort_reverse = False
        self.filter = ""
        self._top = 0  # first line shown (the table scrolls to keep the cursor in view)
        self._borders: tuple[str, str] | None = None  # the title and subtitle set, as words
        self._compact = False
        self._drawn: list[Drawn] = []
        # The rows' lines laid out in the last round (`_drawn_lines`), by what they show, and
        # the layout (columns, widths, compact) they were laid out in.
        self._row_parts: dict[tuple[object, ...], RowParts] = {}
        self._row_parts_layout: tuple[object, ...] = ()
        # The STYLED columns shown: (x0, x1, where in a RowLook its style is), left to right.
        self._styled_at: tuple[tuple[int, int, int], ...] = ()
        self._header = Text()
        self._column_spans: list[tuple[str, int, int]] = []  # (column key, x0, x1) for clicks
        self._layout_key: tuple[object, ...] = ()
        self._laid_out_width: int | None = None  # the content width the lines were laid out at
        self._slow_tick = -1
        self._step_tick = -1
        self._base_style: Style | None = None
        # The header's and the cursor's styles, by name, with the component styles they were
        # made from (`_component_style`).
        self._component_style_kept: dict[str, tuple[object, Style]] = {}
        self._drawing_width: int | None = None  # while render_lines draws

    def on_mount(self) -> None:
        self.border_title = "Processes"

    # ------------------------------------------------------------------ data

    def show(
        self,
        rows: tuple[ProcessRow, ...],
        compact: bool,
        renew: Renewal | bool | None = None,
        jobs: tuple[JobHeader, ...] = (),
    ) -> None:
        """`renew`: whether the slow figures are shown anew now (the dashboard decides it for
        every widget at once, MemtopApp.refresh_view: a Renewal, for the rows on the GPUs it
        names); None: once per slow period.  `jobs`: the fleet view's jobs, each drawn above
        its ranks."""
        tick = slow_tick()
        if renew is None:
            renew = tick != self._slow_tick
        # Every figure anew (a slow period's frame, or an exact one: a paused or ended feed),
        # or a new STEP_S period: the steps too; otherwise the steps as shown.
        step_tick = slow_tick(STEP_S)
        everything = renew.everything if isinstance(renew, Renewal) else renew
        if step_tick != self._step_tick or everything:
            self._step_tick = step_tick
            steps: tuple[str, ...] = ()
        else:
            steps = STEP_FIELDS
        # What a row holds, told at once: one copy of a row that holds both its slow figures
        # and its step, not one for each (a copy of the row's record is ~10 us; eleven rows
        # held both most rounds in the `mixed` demo).
        shown = {row.key: row for row in self.source}
        if isinstance(renew, Renewal) and not renew.everything:
            rows = tuple(
                _hold(row, shown.get(row.key), steps)
                if renew.process(row)
                else _hold(row, shown.get(row.key), SLOW_FIELDS + steps)
                for row in rows
            )
        elif not renew:
            rows = tuple(_hold(row, shown.get(row.key), SLOW_FIELDS + steps) for row in rows)
        else:
            self._slow_tick = tick  # (and every step anew: `everything`)
        self.source = rows
        self.jobs = jobs
        self._compact = compact
        self._arrange()

    def set_sort(self, key: str | None, reverse: bool | None = None) -> None:
        if key is not None and key not in SORTABLE:
            raise ValueError(f"no column {key!r}")
        if reverse is None:
            reverse = not self.sort_reverse if key == self.sort_key else False
        self.sort_key, self.sort_reverse = key, reverse
        self._arrange()

    def set_filter(self, text: str) -> None:
        self.filter = text.strip()
        self._arrange()

    def _matches(self, row: ProcessRow) -> bool:
        if not self.filter:
            return True
        needle = self.filter.lower()
        hay = (
            f"{row.pid} {row.user} gpu{row.gpu_label} {row.full_command or row.command} {row.state}"
        )
        return needle in hay.lower()

    def _arrange(self) -> None:
        """Filter, sort and group the rows; keep the cursor on its process."""
        selected = self.selected_key()
        rows = [r for r in self.source if self._matches(r)]
        if self.sort_key is not None:
            column = next(c for c in COLUMNS if c.key == self.sort_key)
            assert column.sort is not None
            rows.sort(key=column.sort, reverse=self.sort_descending())  # type: ignore[arg-type,return-value]
        lines: list[Line] = []
        placed: set[str] = set()
        # The fleet view: each row's job across hosts, looked up once per row (every second).
        job_of = {member: job for job in self.jobs for member in job.members}
        jobs = {r.key: job_of.get(process_key(r.pid)) for r in rows} if job_of else {}
        for row in rows:
            if row.key in placed:
                continue
            job = jobs.get(row.key)
            ranks = [r for r in rows if jobs[r.key] is job] if job is not None else []
            if job is not None and len({r.pid for r in ranks}) >= 2:  # under its job
                if self.sort_key is None:  # in the job's rank order, then by GPU
                    order = {key: i for i, key in enumerate(job.members)}
                    ranks.sort(key=lambda r: (order[process_key(r.pid)], _num(r.gpu)))
                lines.append(JobLine(job, tuple(ranks)))
                lines.extend(ranks)
                placed.update(r.key for r in ranks)
                continue
            members = [r for r in rows if row.launcher is not None and r.launcher == row.launcher]
            if len(members) >= 2:  # a job of several ranks: under its launcher, in rank order
                if self.sort_key is None:
                    members.sort(key=lambda r: (_num(r.rank), r.pid))
                lines.append(Group(row.launcher, tuple(members)))  # type: ignore[arg-type]
                lines.extend(members)
                placed.update(r.key for r in members)
            else:
                lines.append(row)
                placed.add(row.key)
        self.lines = lines
        self.rows = tuple(line for line in lines if isinstance(line, ProcessRow))
        self.rows_by_key = {row.key: row for row in self.rows}
        keys = [row.key for row in self.rows]
        if selected in self.rows_by_key:
            self.cursor_row = keys.index(selected)
        self.cursor_row = max(0, min(self.cursor_row, len(self.rows) - 1))
        subtitle = self._subtitle()
        # The compact layout draws only the top rule, where the subtitle (the filter, the sort)
        # is not shown: there it goes into the title, or nothing said a filter was on.
        title = f"Processes  {subtitle}" if self._compact and subtitle else "Processes"
        if (title, subtitle) != self._borders:  # setting them, even unchanged, repaints
            self._borders = (title, subtitle)
            # Text, not a str: a str is parsed as markup, and the filter is typed text
            # (`/[/x]` raised MarkupError).
            self.border_subtitle = Text(subtitle)
            self.border_title = Text(title)
        self._render_rows()

    def _subtitle(self) -> str:
        parts = []
        if self.sort_key is not None:
            parts.append(f"sort {self.sort_key} {self._arrow()}")
        if self.filter:
            parts.append(f"filter “{self.filter}” {len(self.rows)}/{len(self.source)}")
        return "  ·  ".join(parts)

    def sort_descending(self) -> bool:
        """Whether the rows run largest first: a column's natural order (sizes descend, pids
        and names ascend), inverted by `I`."""
        column = next((c for c in COLUMNS if c.key == self.sort_key), None)
        return column is not None and column.descending != self.sort_reverse

    def _arrow(self) -> str:
        # What the order is (▼ largest first), not whether `I` was pressed: PID ascending
        # showed ▼ beside USED▼ descending.
        return "▼" if self.sort_descending() else "▲"

    def columns(self, width: int | None = None) -> list[Column]:
        """The columns shown at a content `width` (by default the table's own now)."""
        if width is None:
            width = self.content_region.width
        slot = 1 if self._compact else 0
        gap = GAP
        columns = [c for c in COLUMNS if c.width[slot] or c.key == "command"]
        for key in DROPPABLE:
            used = sum(c.width[slot] + gap for c in columns)
            if width - used >= COMMAND_ROOM:
                break
            columns = [c for c in columns if c.key != key]
        return columns

    def _lay_out(
        self, width: int, size: Size | None = None
    ) -> tuple[tuple[object, ...], list[Column], list[int]]:
        """The columns and their widths at a content `width`, and the key of that layout (a
        new one is a new header and a repaint of every line).  `size`: the table's content
        size, if the caller has it (else looked up)."""
        columns = self.columns(width)
        slot = 1 if self._compact else 0
        widths = [c.width[slot] for c in columns]
        room = width - sum(widths[:-1]) - GAP * (len(columns) - 1) - 1
        widths[-1] = max(8, room)
        layout_key = (
            tuple(widths),
            self._compact,
            len(self.lines),
            self.size if size is None else size,
            self.sort_key,
            self.sort_reverse,  # the header's ▲/▼
        )
        return layout_key, columns, widths

    def _drawn_lines(self, columns: list[Column], widths: list[int]) -> list[Drawn]:
        """Each line as drawn.  A row is laid out anew only when what its cells show moved
        (LINE_FIELDS, its TIME's minute): most rounds its line is last round's, but for its STEP
        (every row's, every STEP_S), which is set between the row's cells laid out around it."""
        layout = (tuple(column.key for column in columns), tuple(widths), self._compact)
        if layout != self._row_parts_layout:
            self._row_parts_layout, self._row_parts = layout, {}
        step_at = next((i for i, c in enumerate(columns) if c.key == "step"), None)
        step_width = widths[step_at] if step_at is not None else 0
        known = self._row_parts
        kept: dict[tuple[object, ...], RowParts] = {}  # this round's rows only: it never grows
        drawn: list[Drawn] = []
        for line in self.lines:
            if isinstance(line, Group | JobLine):
                drawn.append(line.text())
                continue
            key = (_line_fields(line), _runtime(line, False))
            parts = known.get(key)
            if parts is None:
                parts = self._row_parts_of(line, columns, widths, GAP, step_at)
            kept[key] = parts
            before, after, look = parts
            if step_at is None:
                drawn.append((before, look))
            else:
                drawn.append((before + _fit(_step(line, False), step_width, True) + after, look))
        self._row_parts = kept
        return drawn

    def _take_layout(
        self,
        layout_key: tuple[object, ...],
        columns: list[Column],
        widths: list[int],
        drawn: list[Drawn],
        width: int,
    ) -> None:
        """Draw from now on in this layout: its header, its lines, the width it was made for."""
        self._layout_key = layout_key
        self._laid_out_width = width
        self._header, self._column_spans = self._header_text(columns, widths, GAP)
        self._styled_at = tuple(
            (x0, x1, 1 + STYLED.index(key)) for key, x0, x1 in self._column_spans if key in STYLED
        )
        self._drawn = drawn

    def _render_rows(self) -> None:
        """Rebuild each line's text; repaint only the lines that differ from what is shown."""
        # The table's size looked up once a round, not again for the layout's key and twice for
        # each run of lines repainted: each is a search of the screen's map of widgets and the
        # CSS gutter (Widget.size, Widget.content_region).
        size = self.size
        width = size.width
        layout_key, columns, widths = self._lay_out(width, size)
        drawn = self._drawn_lines(columns, widths)
        if layout_key != self._layout_key:
            self._take_layout(layout_key, columns, widths, drawn, width)
            self.refresh(layout=True)
            return
        changed = []
        cells: dict[int, tuple[int, int] | None] = {}
        for index, line in enumerate(drawn):
            shown = self._drawn[index]
            if isinstance(line, Text) or isinstance(shown, Text):
                if isinstance(line, Text) and isinstance(shown, Text):
                    if looks_alike(line, shown):
                        continue
                    cells[index] = changed_cells(shown, line)
                else:  # a row where a group's header was, or the other way round
                    cells[index] = None
            elif line == shown:
                continue
            else:
                # The same look: the characters that moved; another (a trend that turned red,
                # an exited row dimmed): the whole line.
                cells[index] = moved_cells(shown[0], line[0]) if line[1] == shown[1] else None
            self._drawn[index] = line
            changed.append(index)
        # One repaint per run of adjacent changed lines (STEP moves on every row each second:
        # one region, not a refresh per line), as wide as the cells that changed in it: the
        # frame then carries a few cells per row, not whole rows, to the terminal.
        for first, last in _runs(changed):
            spans = [cells[index] for index in range(first, last + 1)]
            if any(span is None for span in spans):
                self._refresh_lines(first, last, size=size)
            else:
                x0 = min(span[0] for span in spans if span is not None)
                x1 = max(span[1] for span in spans if span is not None)
                self._refresh_lines(first, last, x0, x1, size)

    def _header_text(
        self, columns: list[Column], widths: list[int], gap: int
    ) -> tuple[Text, list[tuple[str, int, int]]]:
        """The header line, and each column's (key, x0, x1) on it for clicks."""
        header = Text(" ")
        spans = []
        for column, width in zip(columns, widths, strict=True):
            label = COMPACT_LABELS.get(column.key, column.label) if self._compact else column.label
            if column.key == self.sort_key and len(label) < width:
                # (Where the arrow has no room, "GP…" would say less than the underline and
                # the subtitle's "sort gpu ▲" already do.)
                label = label + self._arrow()
            spans.append((column.key, len(header), len(header) + width))
            header.append(
                _fit(label, width, column.right),
                style="underline" if column.key == self.sort_key else "",
            )
            header.append(" " * gap)
        return header, spans

    def _row_line(
        self, row: ProcessRow, columns: list[Column], widths: list[int], gap: int
    ) -> tuple[str, RowLook]:
        """The row's characters as drawn (one string: every cell fit to its column's width, the
        columns `gap` apart) and its look.  Styled by name, no Rich Text (its spans, its copy
        when drawn) made for it."""
        before, after, look = self._row_parts_of(row, columns, widths, gap, None)
        return before + after, look

    def _row_parts_of(
        self,
        row: ProcessRow,
        columns: list[Column],
        widths: list[int],
        gap: int,
        step_at: int | None,
    ) -> RowParts:
        """The row laid out (`_row_line`) as the characters before its STEP cell and those
        after it (`step_at`: that column's index; None: every cell in the first part)."""
        compact = self._compact
        cells = [
            _fit(column.cell(row, compact), width, column.right)
            for column, width in zip(columns, widths, strict=True)
        ]
        sep = " " * gap
        # No gap after the last column: the row is then the table's width (its last column
        # takes the room left), and drawing it cuts nothing (cutting the gap off every row
        # drawn was most of the table's drawing, Strip.crop; issue 35 item 8).
        if step_at is None:
            before, after = " " + sep.join(cells), ""
        else:
            before = " " + "".join(cell + sep for cell in cells[:step_at])
            after = "".join(sep + cell for cell in cells[step_at + 1 :])
        # An exited process is drawn dim: its figures are the last ones seen (marked ~).
        look = (
            FREE if row.last_known else "",
            "yellow" if row.state == "exited" else "",
            "bold red" if row.trend else "",
        )
        return before, after, look

    def _row_strip(self, plain: str, look: RowLook, width: int, base: Style) -> Strip:
        """A row's line as Textual's segments: its characters in runs between its STYLED cells,
        each run under the row's style and its cell's (as a Rich Text with those spans draws)."""
        own = look[0]
        if not look[1] and not look[2]:
            return pieces_strip(self.app.console, plain, ((plain, (own,)),), width, base)
        pieces: list[tuple[str, tuple[str, ...]]] = []
        at = 0
        for x0, x1, which in self._styled_at:
            if look[which]:
                pieces += ((plain[at:x0], (own,)), (plain[x0:x1], (own, look[which])))
                at = x1
        pieces.append((plain[at:], (own,)))
        return pieces_strip(self.app.console, plain, pieces, width, base)

    # ------------------------------------------------------------------ rendering

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self.lines) + 1

    def notify_style_update(self) -> None:
        self._base_style = None  # the CSS changed (theme, focus, a class): look it up again
        self._component_style_kept.clear()
        self._framed_lines.forget_frame()
        super().notify_style_update()

    def render_lines(self, crop: Region) -> list[Strip]:
        # The content's width looked up once for the lines drawn, not once a line: it is a
        # search of the screen's map and the CSS gutter, about half of drawing a row.
        width = self._drawing_width = self.content_region.width
        if width != self._laid_out_width:
            # The rows were laid out for another width: the dashboard's first build runs
            # before Textual's first layout (for a table of no width: no USER, CPU%, RSS or
            # TIME, the command cut to 8 cells), and a resized terminal's build before the
            # table has its new size.  Laid out again here for the width they are drawn at,
            # before any line is drawn: the frame is right, and there is no second one (the
            # table's own Resize, once the frame is out, finds them laid out already).  No
            # refresh: the whole table is being drawn (a new width is a new size, or new
            # CSS: all of it is repainted), and its height is its line count, not its width.
            layout_key, columns, widths = self._lay_out(width)
            self._take_layout(
                layout_key, columns, widths, self._drawn_lines(columns, widths), width
            )
        try:
            return super().render_lines(crop)
        finally:
            self._drawing_width = None

    def render_line(self, y: int) -> Strip:
        width = self._drawing_width
        if width is None:  # (a line asked for on its own)
            width = self.content_region.width
        # Textual's rich_style walks every ancestor's colours on each call; the table paints
        # up to a line per row every second.
        base = self._base_style
        if base is None:
            base = self._base_style = self.rich_style
        if y == 0:
            style = self._component_style("process-table--header")
            return text_strip(self.app.console, self._header, width, base + style)
        index = self._top + y - 1
        if index >= len(self._drawn):
            return Strip.blank(width, base)
        line = self.lines[index]
        if isinstance(line, ProcessRow) and self._is_cursor(line):
            # Under the row's own styles, so a red trend keeps its colour on the cursor.
            name = "process-table--cursor" if self.has_focus else "process-table--cursor-blurred"
            base = base + self._component_style(name)
        drawn = self._drawn[index]
        if isinstance(drawn, Text):
            return text_strip(self.app.console, drawn, width, base)
        return self._row_strip(*drawn, width, base)

    def _component_style(self, name: str) -> Style:
        """A component's Rich style (the header's, the cursor's), looked up once until the CSS
        changes.  Textual keeps its own copy only until the next refresh(), which the table
        does every round: the cursor's row was a look-up through the CSS (~35 us) each time."""
        styles = self._component_styles.get(name)  # Textual's, replaced when the CSS changes
        kept = self._component_style_kept.get(name)
        if kept is None or kept[0] is not styles:
            kept = self._component_style_kept[name] = (
                styles,
                self.get_component_rich_style(name),
            )
        return kept[1]

    def _is_cursor(self, row: ProcessRow) -> bool:
        # By identity: `lines` holds the very objects of `rows`.  (Searching `rows` for the line
        # compared whole rows field by field, twice, for every line painted.)
        return 0 <= self.cursor_row < len(self.rows) and self.rows[self.cursor_row] is row

    def _row_index(self, row: ProcessRow) -> int:
        return next((i for i, r in enumerate(self.rows) if r is row), -1)

    def _line_of(self, row_index: int) -> int:
        if not self.rows:
            return 0
        row = self.rows[min(row_index, len(self.rows) - 1)]
        return next(i for i, line in enumerate(self.lines) if line is row)

    def _refresh_lines(
        self, first: int, last: int, x0: int = 0, x1: int | None = None, size: Size | None = None
    ) -> None:
        """Repaint lines first..last (indexes into `lines`) where they are in view; only their
        cells x0..x1 when given.  `size`: the table's content size, if the caller has it."""
        if size is None:
            size = self.size
        top = max(1, first - self._top + 1)
        bottom = min(size.height - 1, last - self._top + 1)
        right = size.width if x1 is None else min(x1, size.width)
        if top <= bottom and x0 < right:
            self.refresh(Region(x0, top, right - x0, bottom - top + 1))

    def _refresh_row(self, row_index: int) -> None:
        if self.rows:
            line = self._line_of(row_index)
            self._refresh_lines(line, line)

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
        line = self._line_of(self.cursor_row)
        visible = max(1, self.size.height - 1)
        top = self._top
        if line <= top:  # show the group header above the first rank too
            header = line > 0 and isinstance(self.lines[line - 1], Group | JobLine)
            top = line - 1 if header else line
        elif line >= top + visible:
            top = line - visible + 1
        top = max(0, top)
        if top != self._top:
            self._top = top
            self.refresh()
        else:
            self._refresh_row(before)
            self._refresh_row(self.cursor_row)

    def action_move(self, delta: int) -> None:
        self.move_cursor(self.cursor_row + delta)

    def action_page(self, pages: int) -> None:
        self.move_cursor(self.cursor_row + pages * max(1, self.size.height - 2))

    def action_choose(self) -> None:
        row = self.selected()
        if row is not None:
            self.post_message(self.RowChosen(row))

    def action_sort_column(self, step: int) -> None:
        keys = [c.key for c in self.columns()]
        current = keys.index(self.sort_key) if self.sort_key in keys else -1
        self.set_sort(keys[(current + step) % len(keys)], reverse=False)

    def action_invert_sort(self) -> None:
        self.set_sort(self.sort_key or "gpu", reverse=not self.sort_reverse)

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)  # inside the border and padding
        if offset is None:
            return
        if offset.y == 0:  # a header: sort by that column (again: the other way)
            for key, x0, x1 in self._column_spans:
                if x0 <= offset.x < x1:
                    self.set_sort(key)
            return
        index = self._top + offset.y - 1
        if 0 <= index < len(self.lines) and isinstance(self.lines[index], ProcessRow):
            row_index = self._row_index(self.lines[index])  # type: ignore[arg-type]
            if row_index == self.cursor_row and event.chain >= 2:
                self.action_choose()
            self.move_cursor(row_index)


def _runs(indexes: list[int]) -> list[tuple[int, int]]:
    """Ascending indexes as (first, last) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for index in indexes:
        if runs and runs[-1][1] == index - 1:
            runs[-1] = (runs[-1][0], index)
        else:
            runs.append((index, index))
    return runs


# Every field of a row, in the order its record's __init__ takes them: a held row is made from
# them positionally.  dataclasses.replace builds its keywords and calls __init__ by name, twice
# the cost, and the table holds most rows every round (their STEP, a sawtooth's allocated).
_ROW_FIELDS = tuple(f.name for f in record_fields(ProcessRow))
_row_values = attrgetter(*_ROW_FIELDS)
_ROW_AT = {name: index for index, name in enumerate(_ROW_FIELDS)}
_POSITIONAL = all(f.init and not f.kw_only for f in record_fields(ProcessRow))


def _hold(
    row: ProcessRow, shown: ProcessRow | None, fields: tuple[str, ...] = SLOW_FIELDS
) -> ProcessRow:
    """`row` with the `fields` it showed last (a new or exited row shows its own)."""
    if not fields or shown is None or row.state != shown.state:
        return row
    read, places = _held_fields(fields)
    new, old = read(row), read(shown)
    if new == old:
        return row
    if not _POSITIONAL:  # (a field only its keyword sets)
        return replace(row, **{n: o for n, a, o in zip(fields, new, old, strict=True) if a != o})
    values = list(_row_values(row))
    for at, value, was in zip(places, new, old, strict=True):
        if value != was:
            values[at] = was
    return ProcessRow(*values)


@functools.lru_cache(maxsize=8)
def _held_fields(
    fields: tuple[str, ...],
) -> tuple[Callable[[ProcessRow], tuple[Any, ...]], tuple[int, ...]]:
    """What reads `fields` of a row at once (a tuple, even of one), and their places in the
    record's order: the table holds most rows every round, and a getattr a field, twice, was
    most of it.  (The few tuples of fields a round holds: SLOW_FIELDS, STEP_FIELDS, both.)"""
    getter = attrgetter(*fields)
    read = getter if len(fields) > 1 else lambda row: (getter(row),)
    return read, tuple(_ROW_AT[name] for name in fields)


def _fit(text: str, width: int, right: bool) -> str:
    if len(text) > width:
        return text[: max(0, width - 1)] + "…"
    return text.rjust(width) if right else text.ljust(width)
