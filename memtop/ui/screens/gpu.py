"""A GPU's own detail (enter on its card): every byte the driver counts as used, by who holds
it (the accounting of memtop.engine.observation), each part with its pids and each process with what
memtop can say of it: no agent (attachable or not, and why), another pid namespace, another
user's, an exited pid and the live processes still holding the GPU's device files."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from memtop.figures.units import format_bytes
from memtop.ui.view import GpuDetail
from memtop.ui.widgets.gpu_chart import GpuChart


class GpuScreen(Screen[None]):
    BINDINGS = [Binding("escape,backspace", "app.pop_screen", "Back")]

    DEFAULT_CSS = """
    GpuScreen #gpu-title { height: 1; text-style: bold; }
    GpuScreen #gpu-chart { height: 16; border: round $primary-darken-1; }
    GpuScreen.-short #gpu-chart { height: 10; }
    GpuScreen #gpu-body { height: 1fr; }
    """

    def __init__(self, uuid: str) -> None:
        super().__init__()
        self.uuid = uuid
        self.detail: GpuDetail | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="gpu-title")
        # Its processes' reserved stacked under its used bytes, and its events marked.
        yield GpuChart(id="gpu-chart")
        with VerticalScroll(id="gpu-body"):
            yield Static(id="gpu-accounting")
        yield Footer()

    def on_resize(self) -> None:
        self.set_class(self.size.height < 30, "-short")  # 80×24: the parts need the rows

    def show(self, detail: GpuDetail | None) -> None:
        """Draw `detail` (None: the GPU left the view).  Every string from outside memtop (a
        command line, a user name) goes into a Text as plain text, never through markup."""
        if detail == self.detail and detail is not None:
            return
        self.detail = detail
        title = self.query_one("#gpu-title", Static)
        body = self.query_one("#gpu-accounting", Static)
        if detail is None:
            title.update(Text("GPU gone from view"))
            body.update(Text(""))
            return
        title.update(Text(detail.title))
        self.query_one(GpuChart).show(detail)
        text = Text()
        if detail.missing:
            text.append(f"No accounting: {detail.missing}\n", style="bold red")
        else:
            text.append(
                f"used {format_bytes(detail.used)} of {format_bytes(detail.total)}, by who holds "
                "it (the parts sum to the used bytes)\n\n",
                style="bold",
            )
        for line in detail.lines:
            if line.process:
                text.append(f"      {format_bytes(line.bytes):>10}  ")
                text.append(line.text + "\n", style="dim" if line.bytes is None else "")
                continue
            text.append(f"{format_bytes(line.bytes):>10}  ", style="bold")
            text.append(line.text, style="bold")
            if line.pids:
                text.append(f"  pid {line.pids}")
            text.append("\n")
            if line.note:
                text.append(f"            {line.note}\n", style="italic")
        body.update(text)
