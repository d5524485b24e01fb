"""The control for a Textual dashboard's start, run by bench/tui_cost.py: a Textual app with
nothing of memtop's, one line of text, and its first frame.  Python's start, Textual's import,
its driver, CSS, layout and first frame: no Textual app draws sooner on the same box, so memtop's
full frame is judged beside it (what memtop's own start adds) as well as against its goal."""

from textual.app import App, ComposeResult
from textual.widgets import Static

MARKER = "textual floor USER"  # what bench/tui_cost.py waits for on screen


class Floor(App[None]):
    def compose(self) -> ComposeResult:
        yield Static(MARKER)


if __name__ == "__main__":
    Floor().run()
