"""The detail screen's "who holds it" table: live memory by the user's line (issue 23).

Shown only while the process records stacks (`memtop run --stacks`): one row per site - the
file and line, its source text, live bytes and blocks, the trend in bytes per step - the leak's
line first and marked.  Agent strings were cleaned where they entered the viewer."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from memtop.diagnosis.sites import SiteTrend
from memtop.figures.units import format_bytes

MAX_ROWS = 8


def site_where(trend: SiteTrend) -> str:
    """ "train.py:45", or what blocks without frames are (allocated before stacks were on)."""
    if not trend.site.file:
        return "(before stacks)"
    base = trend.site.file.replace("\\", "/").rsplit("/", 1)[-1]
    return f"{base}:{trend.site.line}"


def sites_table(sites: Sequence[SiteTrend]) -> Table:
    table = Table(box=None, padding=(0, 1), expand=True, show_edge=False)
    table.add_column("site", no_wrap=True, style="cyan")
    table.add_column("source", ratio=1, no_wrap=True, overflow="ellipsis")
    table.add_column("bytes", justify="right", no_wrap=True)
    table.add_column("blocks", justify="right", no_wrap=True)
    table.add_column("trend", justify="right", no_wrap=True)
    for trend in sites[:MAX_ROWS]:
        rate = trend.bytes_per_step
        shown = (
            "—" if rate is None else f"{'+' if rate >= 0 else '-'}{format_bytes(abs(rate))}/step"
        )
        where = Text(site_where(trend))
        if trend.leaking:
            where = Text.assemble(("◀ leak ", "bold red"), site_where(trend))
        table.add_row(
            where,
            Text(trend.site.text),
            format_bytes(trend.bytes),
            f"{trend.blocks} ({trend.old_blocks} old)",
            Text(shown, style="bold red" if trend.leaking else ""),
        )
    return table


class SitesPanel(Static):
    """Hidden until the process's agent serves sites."""

    DEFAULT_CSS = """
    SitesPanel {
        height: auto;
        max-height: 11;
        border: round $primary-darken-1;
        display: none;
    }
    """

    def on_mount(self) -> None:
        self.border_title = "Who holds it (live memory by line)"

    def show(self, sites: Sequence[SiteTrend]) -> None:
        self.display = bool(sites)
        if sites:
            self.update(sites_table(sites))
