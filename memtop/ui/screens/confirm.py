"""A question asked before anything irreversible (signalling a process).

Either yes/no (dismissed with True/False) or a choice of answers (`choices`: key, label,
value, what it does), dismissed with the chosen value or None.  `n`, `esc` and `q` all cancel,
and the dialog's own footer says so (the dashboard's behind it said "q Quit").
"""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Footer, Static

Choice = tuple[str, str, Any, str]  # key, button label, value, what it does


class ConfirmScreen(ModalScreen[Any]):
    BINDINGS = [
        Binding("n,escape,q", "cancel", "Cancel", key_display="n/q/esc", id="confirm.cancel"),
    ]

    def __init__(
        self, question: str, detail: str = "", choices: list[Choice] | None = None
    ) -> None:
        super().__init__()
        self.question = question
        self.detail = detail
        self.choices = choices

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm"):
            yield Static(self.question, classes="question")
            if self.detail:
                yield Static(self.detail, classes="muted")
            if self.choices:
                lines = "\n".join(
                    f"{key}  {label.split(' ')[0]:<5} {what}"
                    for key, label, _, what in self.choices
                )
                yield Static(lines, classes="choices")
            with Horizontal(classes="buttons"):
                if self.choices:
                    for index, (_, label, _, _) in enumerate(self.choices):
                        yield Button(label, variant="error", id=f"choice-{index}")
                else:
                    yield Button("Yes (y)", variant="error", id="yes")
                yield Button("Cancel (n/q/esc)", variant="primary", id="no")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()
        # Toasts stack at the bottom right, where at 80×24 they covered the KILL (9) button;
        # what they said is older than the question (the dialog also stands at the top, above
        # where new ones appear).
        self.app.clear_notifications()

    def on_key(self, event: Any) -> None:
        keys = [c[0] for c in self.choices] if self.choices else ["y"]
        if self.choices and event.key == "y":  # yes: the first (mildest) choice
            event.stop()
            self.dismiss(self.choices[0][2])
        elif event.key in keys:
            event.stop()
            self.dismiss(self.choices[keys.index(event.key)][2] if self.choices else True)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        button = event.button.id or ""
        if button == "yes":
            self.dismiss(True)
        elif button.startswith("choice-") and self.choices:
            self.dismiss(self.choices[int(button.split("-")[1])][2])
        else:
            self.action_cancel()

    def action_cancel(self) -> None:
        self.dismiss(None if self.choices else False)

    # The old name, kept for anyone binding to it.
    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
