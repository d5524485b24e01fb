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

from memtop.figures.units import format_bytes, format_duration
from memtop.ui.fixes import fix_text
from memtop.ui.render import FREE, SEVERITY_STYLES, fragmentation_style, gauge, short_bytes
from memtop.ui.view import Detail, ProcessRow, leak_label
from memtop.ui.widgets.history_chart import HistoryChart
from memtop.ui.widgets.sites_table import SitesPanel
from memtop.ui.widgets.suggestions import BADGES, EFFECT_STYLES

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
        yield HistoryChart(id="chart")
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

    def show(self, detail: Detail) -> None:
        if detail == self.detail:
            return
        self.detail = detail
        self.row = detail.row
        self.query_one("#detail-title", Static).update(_title(detail.row))
        self.query_one(HistoryChart).show(detail)
        self.query_one("#breakdown", Static).update(_breakdown(detail))
        self.query_one("#breakdown").border_title = _breakdown_title(detail)
        self.query_one("#facts", Static).update(_facts(detail))
        self.query_one("#detail-suggestions", Static).update(_suggestions(detail))
        self.query_one(SitesPanel).show(detail.device.sites if detail.device else ())


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
            return Text(
                "No CUDA device (CPU only): judged by its host memory (RSS after each step); "
                "nothing to suggest.",
                FREE,
            )
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
        if item.fix:  # `$ command` or `→ advice`, and whose words (memtop.ui.fixes)
            body.append("\n")
            body.append_text(fix_text(item))
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
    for line in detail.actions:  # what memtop's own actions did (issue 34)
        text.append(f"\n{line}")
    return text
