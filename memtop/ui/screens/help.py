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

# What each binding does, in more words than its footer label; by binding id.
EXPLAIN = {
    "cleanup": "cleanup in the selected trainer: gc.collect() + torch.cuda.empty_cache()",
    "reset_peak": "reset the peak (torch's peak stats and memtop's own)",
    "snapshot": "write a memory snapshot file; open it at https://pytorch.org/memory_viz",
    "kill": "terminate the selected process: TERM, INT or KILL (asks first; your own only)",
    "attach": "attach memtop's agent to the selected process that has none (asks first; gdb)",
    "stacks": "record allocation stacks in the selected trainer, or stop: who holds the memory, "
    "by line, on the detail screen (asks first, says the cost)",
    "copy_fix": "copy a fix to the clipboard: the highlighted suggestion's (suggestions pane) "
    "or the selected process's most severe one (table, detail screen)",
    "filter": "filter the table by pid, user, command or gpuN (enter keeps, esc clears)",
    "pause": "pause / resume sampling",
    "help": "this screen",
    "quit": "quit (memtop demo also stops its simulated trainers)",
    "table.up": "previous process",
    "table.down": "next process",
    "table.page_up": "a page up",
    "table.page_down": "a page down",
    "table.first": "first process",
    "table.last": "last process",
    "table.detail": "open the detail screen of the selected process (history, breakdown)",
    "table.sort_next": "sort by the next column (a click on a header sorts by it)",
    "table.sort_prev": "sort by the previous column",
    "table.sort_invert": "invert the sort order",
}
EXTRA_KEYS = (
    ("tab", "move between the table and the suggestions pane"),
    ("esc", "back from a detail or help screen"),
)


def key_rows(app: object) -> list[tuple[str, str, str]]:
    """(keys as the user's keymap binds them, what it does, binding id), from the bindings."""
    from memtop.ui.app import MemtopApp
    from memtop.ui.widgets.process_table import ProcessTable

    keymap = getattr(app, "_keymap", {}) or {}
    rows = []
    for binding in (*MemtopApp.BINDINGS, *ProcessTable.BINDINGS):
        if not isinstance(binding, Binding) or not binding.id or binding.id == "readonly":
            continue  # (readonly: --readonly's stand-in for the keys that act on a process)
        keys = keymap.get(binding.id, binding.key)
        shown = " ".join(_display(k) for k in keys.split(","))
        rows.append((shown, EXPLAIN.get(binding.id, binding.description), binding.id))
    return rows


def _display(key: str) -> str:
    return {
        "question_mark": "?",
        "slash": "/",
        "greater_than_sign": ">",
        "less_than_sign": "<",
        "up": "↑",
        "down": "↓",
        "pageup": "PgUp",
        "pagedown": "PgDn",
        "home": "Home",
        "end": "End",
        "f1": "F1",
        "f10": "F10",
    }.get(key, key)


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


def help_text(app: object = None) -> Group:
    """Keys (from the bindings, as the user's keymap binds them, with each binding's id for
    config.toml), the bar's legend and the terms, in grids whose last column wraps in place."""
    keys = Table.grid(padding=(0, 2))
    keys.add_column(style="bold cyan", no_wrap=True)
    keys.add_column(ratio=1)
    keys.add_column(style="bright_black", no_wrap=True)
    for key, what, binding_id in key_rows(app):
        keys.add_row(key, what, binding_id)
    for key, what in EXTRA_KEYS:
        keys.add_row(key, what, "")
    legend = Text("  ")
    for glyph, style, name in (
        ("█", ALLOCATED, "allocated  "),
        ("█", CACHED, "cached (reserved, not allocated)  "),
        ("█", OTHER, "outside PyTorch  "),
        ("·", FREE, "free  "),
        ("┃", PEAK, "peak  "),
        ("~", FREE, "last value seen (an exited process)"),
    ):
        legend.append(glyph, style=style)
        legend.append(f" {name}")
    terms = Table.grid(padding=(0, 2))
    terms.add_column(style="bold", no_wrap=True)
    terms.add_column(ratio=1)
    for term, meaning in TERMS:
        terms.add_row(term, meaning)
    readonly = (
        Text("Read-only (--readonly): cleanup, reset, snapshot, kill and attach are off.\n")
        if getattr(app, "readonly", False)
        else Text()
    )
    return Group(
        Text("Keys  (rebind by id in ~/.config/memtop/config.toml [keys])", style="bold underline"),
        readonly,
        keys,
        Text("\nThe GPU bar", style="bold underline"),
        legend,
        Text("\nTerms", style="bold underline"),
        terms,
    )


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape,q,question_mark,f1", "dismiss", "Close", id="help.close"),
    ]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Static(help_text(self.app))

    def on_mount(self) -> None:
        self.query_one("#help").border_title = "memtop help"
        self.query_one("#help").border_subtitle = "esc to close"
