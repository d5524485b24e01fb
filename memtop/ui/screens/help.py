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

from memtop.ui import actions
from memtop.ui.render import ALLOCATED, CACHED, FREE, OTHER, PEAK


def key_rows(app: object) -> list[tuple[str, str, str]]:
    """(keys as the user's keymap binds them, what it does, binding id): the records of this
    app's keys and the table's (memtop.ui.actions); the live dashboard's when `app` is None."""
    from memtop.ui.app import MemtopApp

    keymap = getattr(app, "_keymap", {}) or {}
    rows = []
    for action in (*getattr(app, "ACTIONS", MemtopApp.ACTIONS), *actions.TABLE, *actions.GPU_CARD):
        keys = keymap.get(action.id, action.keys)
        shown = " ".join(_display(k) for k in keys.split(","))
        rows.append((shown, action.explain, action.id))
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
        "left": "←",
        "right": "→",
        "shift+left": "shift+←",
        "shift+right": "shift+→",
        "left_square_bracket": "[",
        "right_square_bracket": "]",
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
    from memtop.ui.app import MemtopApp

    keys = Table.grid(padding=(0, 2))
    keys.add_column(style="bold cyan", no_wrap=True)
    keys.add_column(ratio=1)
    keys.add_column(style="bright_black", no_wrap=True)
    for key, what, binding_id in key_rows(app):
        keys.add_row(key, what, binding_id)
    for key, what in actions.EXTRA_KEYS:
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
        Text(f"Read-only (--readonly): {actions.refused_words(app.ACTIONS)} are off.\n")
        if getattr(app, "readonly", False) and isinstance(app, MemtopApp)
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
