"""The detail screen of one process on one GPU: history chart with the leak trend, the
breakdown of its memory, fragmentation and pressure, and its suggestions in full."""

from __future__ import annotations

import time

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static
from textual_plotext import PlotextPlot

from memtop.ui.render import FREE, SEVERITY_STYLES, fragmentation_style, gauge, short_bytes
from memtop.ui.view import Detail, ProcessRow, leak_label
from memtop.ui.widgets.sites_table import SitesPanel
from memtop.ui.widgets.suggestions import BADGES, EFFECT_STYLES
from memtop.units import GiB, format_bytes, format_duration

# RGB, not colour names: plotext's names go through the terminal's palette (its "yellow" drew
# purple in some themes), and the legend in the chart's title must show the same colours.
COLOURS: dict[str, tuple[int, int, int]] = {
    "reserved": (230, 190, 0),
    "peak": (230, 60, 80),
    "allocated": (140, 220, 40),
    "baseline": (80, 200, 230),
    "leak trend": (240, 240, 240),
    "GPU used": (200, 90, 210),
}
WHITE = (240, 240, 240)


def _hex(rgb: tuple[int, int, int]) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)


BREAKDOWN_ROLES = (
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("optimizer_state", "optimizer"),
    ("other", "activations"),  # and everything else allocated: temporaries, buffers, caches
)


class DetailScreen(Screen[None]):
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
        yield SitesPanel(id="detail-sites")  # shown only while the process records stacks
        yield VerticalScroll(Static(id="detail-suggestions"), id="detail-suggestions-box")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one("#breakdown").border_title = "Breakdown at step boundary"
        self.query_one("#facts").border_title = "Allocator"
        self.query_one("#detail-suggestions-box").border_title = "Suggestions"
        self.query_one("#chart").border_title = "History (GiB, wall-clock time)"

    def show(self, detail: Detail) -> None:
        if detail == self.detail:
            return
        self.detail = detail
        self.row = detail.row
        self.query_one("#detail-title", Static).update(_title(detail.row))
        # The legend under the chart, not inside it over the data.
        lines = [*detail.series, *([detail.trend_line] if detail.trend_line else [])]
        legend = "  ".join(
            f"[{_hex(COLOURS.get(series.name, WHITE))}]■[/] {series.name}" for series in lines
        )
        self.query_one("#chart").border_title = f"History (GiB)  {legend}"
        self._chart(detail)
        self.query_one("#breakdown", Static).update(_breakdown(detail))
        self.query_one("#breakdown").border_title = _breakdown_title(detail)
        self.query_one("#facts", Static).update(_facts(detail))
        self.query_one("#detail-suggestions", Static).update(_suggestions(detail))
        self.query_one(SitesPanel).show(detail.device.sites if detail.device else ())

    def _chart(self, detail: Detail) -> None:
        plot = self.query_one(PlotextPlot)
        plt = plot.plt
        plt.clear_data()
        plt.clear_figure()
        lines = [*detail.series, *([detail.trend_line] if detail.trend_line else [])]
        oldest = 0.0
        for series in lines:
            if not series.xs:
                continue
            oldest = min(oldest, min(series.xs))
            plt.plot(
                list(series.xs),
                [y / GiB for y in series.ys],
                color=COLOURS.get(series.name, WHITE),
                marker="hd",  # quadrant blocks: in more fonts than braille
            )
        if not lines:
            plt.title("no history yet")
        elif detail.newest is not None:
            # Wall-clock ticks: "14:03" reads better than "-1800.0" over a long window.
            ticks = [oldest + (0 - oldest) * i / 4 for i in range(5)]
            span = -oldest
            fmt = "%H:%M:%S" if span < 600 else "%H:%M"
            labels = [time.strftime(fmt, time.localtime(detail.newest + t)) for t in ticks]
            plt.xticks(ticks, labels)
        plot.refresh()


def _title(row: ProcessRow) -> Text:
    text = Text.assemble(
        (f" pid {row.pid} ", "bold black on cyan"),
        f" GPU {row.gpu if row.gpu is not None else '—'}",
        (" · ", FREE),
        (row.state, "yellow" if row.state == "exited" else "green"),
    )
    if row.rocm is not None:
        text.append(f" · ROCm (HIP {row.rocm})")
    if row.rank is not None:
        text.append(f" · rank {row.rank}/{row.world_size or '?'}")
    if row.step is not None:
        text.append(f" · step {row.step}")
    if row.job:
        text.append(f" · {row.job}")  # its scheduler job (cleaned agent text: no markup here)
    text.append(f" · {row.user} · ", style=FREE)
    text.append(row.full_command or row.command)  # the whole line here (the table shortens it)
    text.no_wrap = True
    text.overflow = "ellipsis"
    return text


def _suggestions(detail: Detail) -> Table | Text:
    """Every suggestion in full: a badge column, and the text wrapping beside it."""
    if not detail.suggestions:
        if detail.device is None and detail.row.has_agent:
            return Text("Nothing to judge: this process uses no CUDA device (CPU only).", FREE)
        return Text("Nothing to suggest.", FREE)
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(ratio=1)
    for item in detail.suggestions:
        badge = Text(f" {BADGES.get(item.severity, item.severity)[:5]:<5} ")
        badge.stylize(SEVERITY_STYLES.get(item.severity, ""))
        body = Text(item.title, style="bold")
        if item.effect:
            body.append(f"  {item.effect}", style=EFFECT_STYLES.get(item.effect_kind, "green"))
        if item.detail:
            body.append(f"\n{item.detail}")
        if item.evidence:
            body.append(f"\n{item.evidence}", style=FREE)
        if item.fix:
            body.append("\n$ ", style=FREE)
            body.append(item.fix, style="bold cyan")
        grid.add_row(badge, body)
    return grid


def _breakdown_title(detail: Detail) -> str:
    """Which step the breakdown was measured after, and how long ago: it is served until the
    agent measures the next (every 10 s or so), and lagged a minute behind in one run."""
    device = detail.device
    if device is None or not device.breakdown:
        return "Breakdown at step boundary"
    step = device.breakdown_step
    if device.breakdown_time is None or detail.newest is None:
        return "Breakdown at step boundary" if step is None else f"Breakdown after step {step}"
    age = format_duration(max(0.0, detail.newest - device.breakdown_time))
    return f"Breakdown, {age} ago" if step is None else f"Breakdown after step {step}, {age} ago"


def _breakdown(detail: Detail) -> Text:
    """The parts of what was allocated right after an optimizer step (the agent measures them
    there, when gradients are alive): they add up to that total, which is drawn with them."""
    device = detail.device
    if device is None:
        return _lines(_no_breakdown(detail.row))
    roles = device.breakdown
    if not roles:
        if device.breakdown_measured:
            return _lines(
                [
                    "No optimizer seen yet: the parts",
                    "are counted from the optimizers",
                    "the agent finds (after a step).",
                ]
            )
        return _lines(["Not measured yet: the agent", "measures it after a step, every 10 s."])
    parts = {key: roles.get(key, 0) for key, _ in BREAKDOWN_ROLES}
    total = roles.get("allocated") or sum(parts.values())
    total = max(1, total, sum(parts.values()))
    text = Text(no_wrap=True, overflow="ellipsis")
    for key, name in BREAKDOWN_ROLES:
        value = parts[key]
        text.append(f"{name:<12}{short_bytes(value):>6} {100 * value / total:3.0f} % ")
        text.append(gauge(value / total, 8), style="cyan")
        text.append("\n")
    text.append(f"{'total':<12}{short_bytes(total):>6} 100 %", style="bold")
    fp32 = roles.get("fp32_parameter_bytes")
    if fp32:
        text.append(f"\nfp32 params {short_bytes(fp32):>6}", style=FREE)
    return text


def _no_breakdown(row: ProcessRow) -> list[str]:
    """Why a process has no device to break down, as its state says (the title shows it)."""
    if row.state == "no agent":
        return ["No memtop agent in this process:", "run it under `memtop run` to see its parts."]
    if row.state == "exited":
        return ["The process has exited."]
    if row.state != "agent":
        return [f"Its agent is {row.state}:", "no breakdown until it answers."]
    return [
        "The agent is running; this process",
        "uses no CUDA device (CPU only):",
        "no GPU memory to break down.",
    ]


def _lines(lines: list[str], style: str = FREE) -> Text:
    return Text("\n".join(lines), style=style, no_wrap=True, overflow="ellipsis")


def _facts(detail: Detail) -> Text:
    """Short lines that never wrap: a figure cut across two lines ("4.6 / GiB") misleads."""
    device = detail.device
    row = detail.row
    text = Text(no_wrap=True, overflow="ellipsis")
    if device is None:
        text.append(f"driver-charged {format_bytes(row.used)}")
        return text
    frag = device.fragmentation
    text.append("frag ")
    text.append(f"{frag.gauge_smoothed:.2f}", style=fragmentation_style(frag.gauge_smoothed))
    text.append(f" (now {frag.gauge:.2f}) split {short_bytes(frag.inactive_split_bytes)}\n")
    if frag.external is not None and frag.stranded_bytes is not None:
        text.append(f"stranded {short_bytes(frag.stranded_bytes)} ({frag.external:.2f})\n")
    if frag.largest_free_block_bytes is not None:
        text.append(f"largest cached block {short_bytes(frag.largest_free_block_bytes)}\n")
    p = device.pressure
    text.append(f"retries {p.retries}, OOMs {p.ooms}")
    if p.window_s is not None:
        text.append(f" ({p.retries_recent}/{p.ooms_recent} in {format_duration(p.window_s)})", FREE)
    text.append("\n")
    leak = device.leak
    text.append("trend ", style="bold red" if leak.detected else "")
    if leak.detected:
        # The figures, short (the reason's sentence was cut at "per s…" in a half-width box).
        label = leak_label(leak.bytes_per_step, leak.bytes_per_second, leak.seconds_to_full)
        text.append(f"{label}\n", style="bold red")
    else:
        text.append(f"{leak.reason}\n", style=FREE)
    text.append(
        f"alloc {short_bytes(device.allocated_bytes)} · rsvd {short_bytes(device.reserved_bytes)}"
        f" · releasable {short_bytes(device.releasable_bytes)}\n"
    )
    text.append(f"ALLOC_CONF={detail.allocator_conf or '(unset)'}", style=FREE)
    return text
