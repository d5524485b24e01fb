"""The detail screen of one process on one GPU: history chart with the leak trend, the
breakdown of its memory, fragmentation and pressure, and its suggestions in full."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static
from textual_plotext import PlotextPlot

from memtop.ui.render import FREE, SEVERITY_STYLES, fragmentation_style, gauge, short_bytes
from memtop.ui.view import Detail, ProcessRow
from memtop.ui.widgets.suggestions import BADGES
from memtop.units import GiB, format_bytes, format_duration

COLOURS = {
    "reserved": "yellow",
    "peak": "red",
    "allocated": "green",
    "baseline": "cyan",
    "leak trend": "white",
    "GPU used": "magenta",
}
BREAKDOWN_ROLES = (
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("optimizer_state", "optimizer"),
    ("other", "activations"),  # and everything else allocated: temporaries, buffers, caches
)


class DetailScreen(Screen[None]):
    shows_process = True  # the app's keys act on this screen's process
    BINDINGS = [Binding("escape,backspace", "app.pop_screen", "Back")]

    def __init__(self, row: ProcessRow, gpu_uuid: str | None) -> None:
        super().__init__()
        self.row = row
        self.gpu_uuid = gpu_uuid
        self.detail: Detail | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="detail-title")
        yield PlotextPlot(id="chart")
        with Horizontal(id="detail-facts"):
            yield Static(id="breakdown")
            yield Static(id="facts")
        yield VerticalScroll(Static(id="detail-suggestions"), id="detail-suggestions-box")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one("#breakdown").border_title = "Breakdown"
        self.query_one("#facts").border_title = "Allocator"
        self.query_one("#detail-suggestions-box").border_title = "Suggestions"
        self.query_one("#chart").border_title = "History (GiB, seconds ago)"

    def show(self, detail: Detail) -> None:
        if detail == self.detail:
            return
        self.detail = detail
        self.row = detail.row
        self.query_one("#detail-title", Static).update(_title(detail.row))
        self._chart(detail)
        self.query_one("#breakdown", Static).update(_breakdown(detail))
        self.query_one("#facts", Static).update(_facts(detail))
        self.query_one("#detail-suggestions", Static).update(_suggestions(detail))

    def _chart(self, detail: Detail) -> None:
        plot = self.query_one(PlotextPlot)
        plt = plot.plt
        plt.clear_data()
        plt.clear_figure()
        lines = [*detail.series, *([detail.trend_line] if detail.trend_line else [])]
        for series in lines:
            if not series.xs:
                continue
            plt.plot(
                list(series.xs),
                [y / GiB for y in series.ys],
                label=series.name,
                color=COLOURS.get(series.name, "white"),
                marker="hd",  # quadrant blocks: in more fonts than braille
            )
        if not lines:
            plt.title("no history yet")
        plot.refresh()


def _title(row: ProcessRow) -> Text:
    text = Text.assemble(
        (f" pid {row.pid} ", "bold black on cyan"),
        f"  GPU {row.gpu if row.gpu is not None else '—'}",
        ("  ·  ", FREE),
        (row.state, "yellow" if row.state == "exited" else "green"),
    )
    if row.step is not None:
        text.append(f"  ·  step {row.step}")
    text.append(f"  ·  {row.user}  ·  ", style=FREE)
    text.append(row.command)
    return text


def _suggestions(detail: Detail) -> Table | Text:
    """Every suggestion in full: a badge column, and the text wrapping beside it."""
    if not detail.suggestions:
        return Text("Nothing to suggest.", FREE)
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(ratio=1)
    for item in detail.suggestions:
        badge = Text(f" {BADGES.get(item.severity, item.severity)[:5]:<5} ")
        badge.stylize(SEVERITY_STYLES.get(item.severity, ""))
        body = Text(item.title, style="bold")
        if item.effect:
            body.append(f"  {item.effect}", style="green")
        if item.evidence:
            body.append(f"\n{item.evidence}", style=FREE)
        if item.fix:
            body.append("\n$ ", style=FREE)
            body.append(item.fix, style="bold cyan")
        grid.add_row(badge, body)
    return grid


def _breakdown(detail: Detail) -> Text:
    device = detail.device
    if device is None:
        return Text(
            "No agent in this process: run it under `memtop run` to see what its memory is.",
            FREE,
        )
    roles = device.breakdown
    if not roles:
        return Text("Waiting for the agent's first breakdown (every 10 s).", FREE)
    total = max(1, device.allocated_bytes, sum(roles.get(k, 0) for k, _ in BREAKDOWN_ROLES))
    text = Text()
    for key, name in BREAKDOWN_ROLES:
        value = roles.get(key, 0)
        text.append(f"{name:<12}{short_bytes(value):>6} {100 * value / total:3.0f} % ")
        text.append(gauge(value / total, 10), style="cyan")
        text.append("\n")
    fp32 = roles.get("fp32_parameter_bytes")
    if fp32:
        text.append(f"fp32 parameters {format_bytes(fp32)}\n", style=FREE)
    return text


def _facts(detail: Detail) -> Text:
    device = detail.device
    row = detail.row
    text = Text()
    if device is None:
        text.append(f"driver-charged {format_bytes(row.used)}\n")
        return text
    frag = device.fragmentation
    text.append("fragmentation ")
    text.append(f"{frag.gauge_smoothed:.2f}", style=fragmentation_style(frag.gauge_smoothed))
    text.append(f" (now {frag.gauge:.2f}), split {format_bytes(frag.inactive_split_bytes)}\n")
    if frag.external is not None and frag.stranded_bytes is not None:
        text.append(
            f"stranded by splits {format_bytes(frag.stranded_bytes)} ({frag.external:.2f})\n"
        )
    if frag.largest_free_block_bytes is not None:
        text.append(f"largest request from cache {format_bytes(frag.largest_free_block_bytes)}\n")
    if frag.internal_bytes is not None:
        text.append(f"internal (rounding) {format_bytes(frag.internal_bytes)}\n")
    p = device.pressure
    text.append(f"retries {p.retries}, OOMs {p.ooms}")
    if p.window_s is not None:
        text.append(
            f" ({p.retries_recent} / {p.ooms_recent} in {format_duration(p.window_s)})", FREE
        )
    text.append("\n")
    leak = device.leak
    text.append("trend ", style="bold red" if leak.detected else "")
    text.append(f"{leak.reason}\n", style="bold red" if leak.detected else FREE)
    text.append(
        f"allocated {format_bytes(device.allocated_bytes)}, "
        f"reserved {format_bytes(device.reserved_bytes)}, "
        f"releasable {format_bytes(device.releasable_bytes)}\n"
    )
    text.append(f"PYTORCH_CUDA_ALLOC_CONF={detail.allocator_conf or '(unset)'}", style=FREE)
    return text
