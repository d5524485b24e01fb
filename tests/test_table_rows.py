"""The process table draws its rows straight from their ProcessRows (issue 35 item 4): no Rich
`Text` made for a row, round after round, and each row's line the very segments a Rich Text of
the row's characters and styled cells draws (the frozen screens pin the whole picture)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from rich.segment import Segment
from rich.text import Span, Text
from ui_frozen import MY_UID, NOW, frozen_store
from ui_helpers import steps_moved

from memtop.engine.observation import ProcessState
from memtop.ui.app import MemtopApp
from memtop.ui.render import FREE
from memtop.ui.widgets.lines import text_strip
from memtop.ui.widgets.process_table import Group, ProcessTable

ROUNDS = 5


def _app() -> MemtopApp:
    return MemtopApp(frozen_store(), None, clock=lambda: NOW, host="gpu-box", my_uid=MY_UID)


def _varied(table: ProcessTable) -> tuple:  # type: ignore[type-arg]
    """The frozen rows, one of each look: a leak (red TREND), an exited rank (dim, yellow STEP,
    its leak as last seen), two ranks under their launcher (a group's header line)."""
    rows = list(table.source)
    assert len(rows) >= 4
    rows[0] = replace(rows[0], trend="+1.0M/step")
    rows[1] = replace(
        rows[1], state=ProcessState.EXITED, trend="was +8.0M/step", launcher=9, rank=1
    )
    rows[2] = replace(rows[2], launcher=9, rank=0)
    return tuple(rows)


def _as_rich_text(table: ProcessTable, index: int, plain: str) -> Text:
    """The row's line as a Rich Text: its characters, the row's style, its styled cells as
    spans (what the table drew before it drew rows itself)."""
    row = table.lines[index]
    at = {key: (x0, x1) for key, x0, x1 in table._column_spans}
    spans = []
    if row.state == "exited":
        spans.append(Span(*at["step"], "yellow"))
    if row.trend:
        spans.append(Span(*at["trend"], "bold red"))
    return Text(plain, style=FREE if row.last_known else "", spans=spans)


@pytest.mark.parametrize("size", [(80, 24), (120, 36)])
def test_the_table_draws_its_rows_without_a_rich_text_per_row(
    monkeypatch: pytest.MonkeyPatch, size: tuple[int, int]
) -> None:
    app = _app()
    made = [0]
    init = Text.__init__

    def counted(self: Text, *args: object, **kwargs: object) -> None:
        made[0] += 1
        init(self, *args, **kwargs)  # type: ignore[arg-type]

    async def run() -> tuple[int, int, list[list[Segment]]]:
        async with app.run_test(size=size) as pilot:
            await pilot.pause(0.2)
            table = app.table
            # (No await from here on: the dashboard's own round would show its rows again.)
            table.show(_varied(table), False, True)
            headers = sum(isinstance(line, Group) for line in table.lines)
            rows = len(table.rows)
            drawn: list[list[Segment]] = []
            monkeypatch.setattr(Text, "__init__", counted)
            for _ in range(ROUNDS):  # rounds whose steps moved, each row drawn anew
                table.show(
                    steps_moved(table),
                    False,
                    True,
                )
                drawn = [list(table.render_line(y)) for y in range(1, len(table.lines) + 1)]
            monkeypatch.undo()
            # A group's header is styled words (a Rich Text, one a round); a row is none.
            assert made[0] <= ROUNDS * headers, f"{made[0]} Texts made in {ROUNDS} rounds"
            # Each row drawn is the segments of the Rich Text of its characters and styles:
            # the same bytes to the terminal as before (the cursor's row too).
            for index, line in enumerate(table.lines):
                if isinstance(line, Group):
                    continue
                base = table.rich_style
                if table._is_cursor(line):
                    focus = "" if table.has_focus else "-blurred"
                    base += table.get_component_rich_style(f"process-table--cursor{focus}")
                width = table.content_region.width
                plain = "".join(segment.text for segment in drawn[index])
                text = _as_rich_text(table, index, plain)
                expected = text_strip(app.console, text, width, base)
                assert drawn[index] == list(expected), (index, line.pid)
            return headers, rows, drawn

    headers, rows, drawn = asyncio.run(run())
    assert rows >= 4 and headers == 1 and len(drawn) == rows + headers
