"""The `?` screen: every key, the legend of the bars, and what the numbers mean."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from memtop.ui.render import ALLOCATED, CACHED, FREE, OTHER, PEAK

KEYS = (
    ("↑ ↓  tab", "move between processes; tab moves between the table and the suggestions"),
    ("enter", "open the detail screen of the selected process (history chart, breakdown)"),
    ("c", "cleanup in the selected trainer: gc.collect() + torch.cuda.empty_cache()"),
    ("r", "reset the peak (torch's peak stats and memtop's own)"),
    ("s", "write a memory snapshot file; open it at https://pytorch.org/memory_viz"),
    ("k", "terminate the selected process (SIGTERM, asks first; your own processes only)"),
    ("y", "copy the highlighted suggestion's fix to the clipboard"),
    ("p", "pause / resume sampling"),
    ("esc", "back from a detail or help screen"),
    ("q", "quit (memtop demo also stops its simulated trainers)"),
)

TERMS = (
    ("allocated", "bytes in live tensors (torch.cuda.memory_allocated)"),
    ("reserved", "bytes the caching allocator holds from the driver, allocated + cached"),
    (
        "outside PyTorch",
        "what the driver charges beyond the agents' reserved bytes: CUDA "
        "context, NCCL, other libraries, processes without an agent",
    ),
    (
        "peak",
        "torch's highest allocated since start or the last reset (exact, not sampled); "
        "a GPU card's Σpeak adds up its processes' peaks",
    ),
    (
        "frag",
        "inactive split bytes / reserved bytes of the large pool, median of 10 samples; "
        "≥ 0.20 is worth fixing",
    ),
    ("trend", "allocated right after each step (the baseline); a leak is a rising staircase"),
)


def help_text() -> Group:
    """Keys, the bar's legend and the terms, in grids whose second column wraps in place."""
    keys = Table.grid(padding=(0, 2))
    keys.add_column(style="bold cyan", no_wrap=True)
    keys.add_column(ratio=1)
    for key, what in KEYS:
        keys.add_row(key, what)
    legend = Text("  ")
    for glyph, style, name in (
        ("█", ALLOCATED, "allocated  "),
        ("█", CACHED, "cached (reserved, not allocated)  "),
        ("█", OTHER, "outside PyTorch  "),
        ("·", FREE, "free  "),
        ("┃", PEAK, "peak"),
    ):
        legend.append(glyph, style=style)
        legend.append(f" {name}")
    terms = Table.grid(padding=(0, 2))
    terms.add_column(style="bold", no_wrap=True)
    terms.add_column(ratio=1)
    for term, meaning in TERMS:
        terms.add_row(term, meaning)
    return Group(
        Text("Keys", style="bold underline"),
        keys,
        Text("\nThe GPU bar", style="bold underline"),
        legend,
        Text("\nTerms", style="bold underline"),
        terms,
    )


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape,q,question_mark", "dismiss", "Close"),
    ]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Static(help_text())

    def on_mount(self) -> None:
        self.query_one("#help").border_title = "memtop help"
        self.query_one("#help").border_subtitle = "esc to close"
