"""Every key that does something, one record each: the one table the bindings, the footer, the
help screen, `--readonly`, the replay and the README's key table (its test) all read.

Adding a key is its record here plus its handler (`action_<name>` on the app, or on the
widget that owns the group).  Whether it works under `--readonly`, whether a replay offers it,
whether it sleeps behind a dialog and what the help screen says come from the record alone:
they were four parallel lists of binding ids once, and `w` (stacks), missing from all of them,
turned on stack recording inside a trainer under `--readonly` (issue 35).

Imports Textual's Binding only: no app, no widget (the help screen and the tests read it).
"""

from __future__ import annotations

from collections.abc import Iterable

from textual.binding import Binding, BindingType

from memtop.base.records import record

READONLY_ID = "readonly"  # --readonly's stand-in for the keys that act on a process


@record(frozen=True, slots=True)
class Action:
    """One key that does something.

    `id` is the binding id: the user's keymap (config.toml [keys]) rebinds by it, the help
    screen prints it and the README's key table names it.  `run` is what a press runs, as
    Textual spells it: "cleanup" runs `action_cleanup`, "seek(-1)" `action_seek(-1)`."""

    id: str
    keys: str  # default keys, Textual's names, comma-separated ("question_mark,f1")
    run: str
    label: str  # the footer's word(s)
    explain: str  # the help screen's line
    show: bool = True  # in the footer (at 80 columns it is spoken for)
    key_display: str | None = None
    tooltip: str = ""
    # It reaches into a process (an agent's command, a signal, gdb): never under --readonly,
    # never on a replay (there is no process).
    acts_on_process: bool = False
    # Through the process's memtop agent; `command` is the protocol command it sends.
    needs_agent: bool = False
    command: str | None = None
    # It asks before it acts; these are the question's words where they are fixed (the
    # dialogs for kill and attach say the pid, its command and its owner).
    asks: str = ""
    # Needs a live feed (a replay does not offer it) though it touches no process.
    live_only: bool = False
    # Asleep while a dialog or the help screen is up (their own keys answer there).
    asleep_behind_dialogs: bool = True
    on_detail: bool = True  # offered on the detail screen

    @property
    def method(self) -> str:
        """The action's name without its arguments, as Textual's check_action is asked it."""
        return self.run.split("(", 1)[0]

    @property
    def offered_on_replay(self) -> bool:
        return not (self.acts_on_process or self.live_only)

    def binding(self) -> Binding:
        return Binding(
            self.keys,
            self.run,
            self.label,
            show=self.show,
            key_display=self.key_display,
            tooltip=self.tooltip,
            id=self.id,
        )


# What the stacks key says before it asks: the cost, in the user's terms.
STACKS_COST = (
    "torch then records the Python stack of every allocation (enabled='state', Python frames): "
    "a few % of step time in allocation-heavy steps, and snapshots get slower; memtop groups "
    "live blocks at most every 2 s, within 1 % of the trainer's time. New blocks only: what is "
    "already allocated has no stack."
)

# What the expandable-segments key says before it asks (the exact strings come with it).
EXPANDABLE_SEGMENTS_EFFECT = (
    "torch's caching allocator grows new segments as expandable ones from the trainer's next "
    "step on (memtop writes the whole setting back: the trainer's other allocator keys stay). "
    "Segments already cached keep their kind until the cache is emptied; emptying it now "
    "releases the wholly free ones, and the next steps allocate afresh."
)

# The dashboard's keys, in the footer's order.
DASHBOARD: tuple[Action, ...] = (
    Action(
        "cleanup",
        "c",
        "cleanup",
        "Cleanup",
        "cleanup in the selected trainer: gc.collect() + torch.cuda.empty_cache()",
        tooltip="gc.collect() + empty_cache()",
        acts_on_process=True,
        needs_agent=True,
        command="cleanup",
    ),
    Action(
        "reset_peak",
        "r",
        "reset_peak",
        "Reset",
        "reset the peak (torch's peak stats and memtop's own)",
        tooltip="reset the peak",
        acts_on_process=True,
        needs_agent=True,
        command="reset_peak",
    ),
    Action(
        "snapshot",
        "s",
        "snapshot",
        "Snapshot",
        "write a memory snapshot file; open it at https://pytorch.org/memory_viz",
        acts_on_process=True,
        needs_agent=True,
        command="snapshot",
    ),
    Action(
        "kill",
        "k",
        "terminate",
        "Kill",
        "terminate the selected process: TERM, INT or KILL (asks first; your own only)",
        acts_on_process=True,
        asks="which signal: TERM, INT or KILL",
    ),
    # Off the footer (80 columns are spoken for); in the help screen.
    Action(
        "attach",
        "a",
        "attach",
        "Attach",
        "attach memtop's agent to the selected process that has none (asks first; gdb)",
        show=False,
        acts_on_process=True,
        asks="whether to pause it a moment (gdb / ptrace) to start memtop's agent in it",
    ),
    Action(
        "stacks",
        "w",
        "stacks",
        "Stacks",
        "record allocation stacks in the selected trainer, or stop: who holds the memory, "
        "by line, on the detail screen (asks first, says the cost)",
        show=False,
        acts_on_process=True,
        needs_agent=True,
        command="sites",
        asks=STACKS_COST,
    ),
    Action(
        "expandable",
        "e",
        "expandable_segments",
        "Expandable",
        "turn on expandable segments in the selected trainer, live, at its next step "
        "(asks first: what changes, and how to undo it)",
        show=False,
        acts_on_process=True,
        needs_agent=True,
        command="tune",
        asks=EXPANDABLE_SEGMENTS_EFFECT,
    ),
    Action(
        "copy_fix",
        "y",
        "copy_fix",
        "Copy fix",
        "copy a fix to the clipboard: the highlighted suggestion's (suggestions pane) "
        "or the selected process's most severe one (table, detail screen)",
    ),
    Action(
        "filter",
        "slash",
        "filter",
        "Filter",
        "filter the table by pid, user, command or gpuN (enter keeps, esc clears)",
        key_display="/",
        on_detail=False,
    ),
    Action(
        "pause",
        "p",
        "pause",
        "Pause",
        "pause / resume sampling",
        live_only=True,  # a replay pauses with space (its own key)
        on_detail=False,
    ),
    Action(
        "help",
        "question_mark,f1",
        "help",
        "Help",
        "this screen",
        key_display="?",
        asleep_behind_dialogs=False,
    ),
    Action(
        "quit",
        "q,f10",
        "quit",
        "Quit",
        "quit (memtop demo also stops its simulated trainers)",
        asleep_behind_dialogs=False,
    ),
)

# The process table's keys (memtop.ui.widgets.process_table binds them), off the footer.
TABLE: tuple[Action, ...] = tuple(
    Action(id_, keys, run, label, explain, show=False, asleep_behind_dialogs=False)
    for id_, keys, run, label, explain in (
        ("table.up", "up", "move(-1)", "Up", "previous process"),
        ("table.down", "down", "move(1)", "Down", "next process"),
        ("table.page_up", "pageup", "page(-1)", "Page up", "a page up"),
        ("table.page_down", "pagedown", "page(1)", "Page down", "a page down"),
        ("table.first", "home,g", "move(-1000000)", "First", "first process"),
        ("table.last", "end,G", "move(1000000)", "Last", "last process"),
        (
            "table.detail",
            "enter",
            "choose",
            "Detail",
            "open the detail screen of the selected process (history, breakdown)",
        ),
        (
            "table.sort_next",
            "greater_than_sign",
            "sort_column(1)",
            "Sort →",
            "sort by the next column (a click on a header sorts by it)",
        ),
        (
            "table.sort_prev",
            "less_than_sign",
            "sort_column(-1)",
            "Sort ←",
            "sort by the previous column",
        ),
        ("table.sort_invert", "I", "invert_sort", "Invert sort", "invert the sort order"),
    )
)

# A GPU card's keys (memtop.ui.widgets.gpu_panel binds them; the cards take focus by tab).
GPU_CARD: tuple[Action, ...] = (
    Action(
        "gpu.detail",
        "enter",
        "choose",
        "GPU detail",
        "open the GPU's own detail: its used memory by who holds it (tab to its card)",
        show=False,
        asleep_behind_dialogs=False,
    ),
)

# A replay's own keys (memtop.ui.replay_app), first in its footer: at 80 columns it shows them
# all, then the shared ones.
REPLAY: tuple[Action, ...] = tuple(
    Action(
        id_, keys, run, label, explain, show=show, key_display=shown, asleep_behind_dialogs=False
    )
    for id_, keys, run, label, explain, show, shown in (
        ("replay.play", "space", "toggle_play", "Play", "pause / play the recording", True, None),
        ("replay.back", "left", "seek(-1)", "Back", "10 s back", True, "←"),
        ("replay.forward", "right", "seek(1)", "Forward", "10 s forward", True, "→"),
        ("replay.back_more", "shift+left", "seek(-6)", "Back 60 s", "60 s back", False, None),
        (
            "replay.forward_more",
            "shift+right",
            "seek(6)",
            "Forward 60 s",
            "60 s forward",
            False,
            None,
        ),
        ("replay.slower", "left_square_bracket", "speed(0)", "Slower", "half speed", True, "["),
        ("replay.faster", "right_square_bracket", "speed(1)", "Faster", "double speed", True, "]"),
    )
)

# Keys the help screen lists that are no binding of ours (Textual's focus chain, screens' own).
EXTRA_KEYS = (
    ("tab", "move between the table and the suggestions pane"),
    ("esc", "back from a detail or help screen"),
)


def on_replay(actions: Iterable[Action]) -> tuple[Action, ...]:
    """A replay's keys: its own, then the shared ones that neither act on a process nor need a
    live feed."""
    return (*REPLAY, *(a for a in actions if a.offered_on_replay))


def acting(actions: Iterable[Action]) -> tuple[Action, ...]:
    """The keys that act on a process: off under --readonly."""
    return tuple(a for a in actions if a.acts_on_process)


def refused_words(actions: Iterable[Action]) -> str:
    """What --readonly takes off, in words: "cleanup, reset, snapshot, kill, attach, stacks"."""
    return ", ".join(a.label.lower() for a in acting(actions))


def readonly_binding(actions: Iterable[Action]) -> Binding:
    """Only under --readonly, in place of the keys that act on a process (their keys are its,
    as the user's keymap binds them): the footer says "read-only" and a press says why
    nothing happens."""
    keys = ",".join(a.keys for a in acting(actions))
    return Binding(keys, "read_only", "read-only", key_display="·", id=READONLY_ID)


def bindings(actions: Iterable[Action]) -> list[BindingType]:
    """The Textual bindings of `actions`, plus --readonly's stand-in where any acts on a
    process."""
    actions = tuple(actions)
    made: list[BindingType] = [a.binding() for a in actions]
    if acting(actions):
        made.append(readonly_binding(actions))
    return made
