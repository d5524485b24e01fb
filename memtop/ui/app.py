"""The Textual dashboard (DESIGN §8).

The app renders from the store at the refresh interval and never does I/O on its own thread:
agent commands run on the sampler's action workers, terminating a process on a thread worker,
and their outcomes come back as notifications.
"""

from __future__ import annotations

import concurrent.futures
import gc
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from rich.text import Text
from textual import events
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.css.query import NoMatches
from textual.markup import escape
from textual.message import Message
from textual.notifications import SeverityLevel
from textual.screen import ModalScreen
from textual.widgets import Footer, Input, OptionList, Static

from memtop.base import alloc_conf, start_gc
from memtop.engine.feed import ActionReply, Feed, still_feed
from memtop.engine.observation import Observation, Observer
from memtop.engine.scope import Scope
from memtop.figures.units import format_bytes
from memtop.model import AgentCleanup, AgentResetPeak, AgentSnapshot, AgentTune, snapshot_note
from memtop.ui import actions, fixes, view
from memtop.ui.config import UiConfig
from memtop.ui.lean_screen import LeanScreen
from memtop.ui.render import FREE
from memtop.ui.renewal import EVERYTHING, Renewal, RenewalClock
from memtop.ui.widgets.gpu_panel import GpuCard, GpuPanel
from memtop.ui.widgets.process_table import ProcessTable
from memtop.ui.widgets.suggestions import SuggestionsPane

LINUX_DRIVER = "textual.drivers.linux_driver.LinuxDriver"  # by name: not imported elsewhere

if TYPE_CHECKING:
    from textual.driver import Driver
    from textual.geometry import Size

    from memtop.ui.screens.detail import DetailScreen
    from memtop.ui.screens.gpu import GpuScreen

COMPACT_WIDTH = 100  # narrower than this: short numbers, fewer columns
COMPACT_HEIGHT = 30
ACTION_TIMEOUT_S = 15.0
EVENT_SHOW_S = 8.0  # "agent N attached" and the like stay this long in the status line
# The signals `k` offers, in its dialog's order: (key, name, signal, what it does).
SIGNALS = (
    ("t", "TERM", signal.SIGTERM, "ask it to stop (it may save and exit)"),
    ("i", "INT", signal.SIGINT, "as Ctrl-C in its terminal (KeyboardInterrupt)"),
    ("9", "KILL", signal.SIGKILL, "stop it at once (nothing saved)"),
)


class Sampled(Message):
    """A sampling round landed in the store (posted from the sampler thread)."""


class DashboardScreen(LeanScreen):
    """The dashboard's screen, its process table focused from the start.  Textual focuses a
    screen's first focusable widget as it composes it (AUTO_FOCUS "*"): that was the filter
    line, hidden until `/` but focusable, and `on_mount` then moved the focus to the table.
    The line's focus and blur (its restyles, its validation) ran before the first frame, which
    waited for them (issue 35 item 8: docs/architecture.md, the dashboard's start)."""

    AUTO_FOCUS = "#processes"
    # Whether the screen has been shown: its first ScreenResume comes right after its mount.
    _shown_once = False

    def _on_screen_resume(self, event: events.ScreenResume) -> None:
        """The first resume (Textual's ScreenResume, the dashboard's first frame drawn within
        its handler) keeps the styles the widgets were given as they mounted, just before:
        Textual restyled every node of the screen again (refresh_styles), for what had changed
        while it was suspended, which at the start is nothing (~8 ms of the start's main
        thread on a loaded box; docs/architecture.md).  Every later resume (back from the
        detail, GPU or help screen) restyles as Textual does.  Screen's own handler runs after
        this one (Textual calls each class's in the MRO) and reads `refresh_styles`."""
        if not self._shown_once:
            self._shown_once = True
            event.refresh_styles = False


class MemtopApp(App[None]):
    TITLE = "memtop"
    CSS_PATH = "memtop.tcss"
    ENABLE_COMMAND_PALETTE = False
    # Every key is one record of memtop.ui.actions (id, keys, footer and help words, whether it
    # acts on a process): the bindings, --readonly, the help screen and the replay read them.
    # The user's keymap (config.toml [keys]) rebinds by id.
    ACTIONS: ClassVar[tuple[actions.Action, ...]] = actions.DASHBOARD
    BINDINGS = actions.bindings(ACTIONS)
    ACTION_OF: ClassVar[dict[str, actions.Action]] = {a.method: a for a in ACTIONS}  # by action

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A subclass that names its own ACTIONS gets its bindings from them, before Textual
        # merges them (a replay: its own keys and the shared ones that reach no process).
        if "ACTIONS" in cls.__dict__ and "BINDINGS" not in cls.__dict__:
            # (Without inherit_bindings, Textual's own, ctrl+q and the like, come back here.)
            inherited = [] if kwargs.get("inherit_bindings", True) else list(App.BINDINGS)
            cls.BINDINGS = [*inherited, *actions.bindings(cls.ACTIONS)]
        cls.ACTION_OF = {a.method: a for a in cls.ACTIONS}
        super().__init_subclass__(**kwargs)

    def __init__(
        self,
        store: object,
        sampler: Feed | None = None,
        *,
        interval: float = 1.0,
        snapshot_dir: Path | None = None,
        clock: Callable[[], float] = time.time,
        host: str | None = None,
        my_uid: int | None = None,
        observer: Observer | None = None,
        only: set[int] | frozenset[int] | None = None,
        config: UiConfig | None = None,
        scope: Scope | None = None,
        readonly: bool = False,
        before_first_frame: Callable[[], object] | None = None,
    ) -> None:
        super().__init__()
        # The store the feed writes (the app reads it only through the feed and its observer;
        # a store handed without a feed is a frozen picture).
        self.store = store
        self.sampler = sampler  # None: nothing is live here (no action is offered)
        self.feed: Feed = sampler if sampler is not None else still_feed(store)
        self.interval = interval
        # Absolute, never resolved (a path the agent opens keeps its links for its checks).
        self.snapshot_dir = Path.cwd() / (snapshot_dir or "")
        self.clock = clock
        self.host = host
        self.my_uid = os.getuid() if my_uid is None else my_uid
        # One observer for the app's life (it holds the one Diagnoser and its leak verdicts);
        # every panel and screen renders the one observation it builds per store generation.
        self.observer = observer or self.feed.observer(clock=clock, host=host, uid=self.my_uid)
        self.dashboard: view.Dashboard | None = None
        self.observation: Observation | None = None
        self._generation = -1
        self._exact = False  # the screen shows every figure of its round (none held)
        self.renewals = RenewalClock()  # which GPUs' held figures a round shows anew
        self._layout: tuple[bool, bool] | None = None
        self._shown: dict[str | None, tuple[object, ...]] = {}  # what each Static shows now
        self._mounted = False  # the first Resize arrives before on_mount
        self._view_size: Size | None = None  # the terminal's size the view was last built at
        self.refreshes = 0
        # What the user asked to see (--only 0,2, --user NAME, --pid PID): every panel renders
        # the observation through it (memtop.engine.scope).
        self.scope = scope or Scope()
        if only:
            self.scope = replace(self.scope, gpus=frozenset(only))
        self._scope_warned = False
        self.config = config or UiConfig()
        self.readonly = readonly  # --readonly, or readonly = true in the config
        self._users: dict[int, str] = {}  # pid → owner, remembered past the process's exit
        self._event: tuple[str | None, float] = (None, 0.0)  # status message, when first seen
        self.cell_diff: Any = None  # memtop.ui.cell_diff.CellDiff once the driver runs
        # The dashboard's start (memtop.commands.watch): its wait for the first round, which
        # returns once the round landed or the start's budget is spent, then the splash's
        # hand-over.  Run in on_mount, where the first frame is drawn (Textual draws nothing
        # before: the mount is in its batch update), so Textual's own start (its driver, the
        # CSS, the widgets' mount: ~0.1 s) runs while the agents answer rather than after.
        self.before_first_frame = before_first_frame

    # ------------------------------------------------------------------ layout

    def get_default_screen(self) -> LeanScreen:
        # Each frame renders only the widgets that paint where something changed.
        return DashboardScreen(id="_default")

    def compose(self) -> ComposeResult:
        yield Static(Text(" memtop ", "bold black on cyan"), id="header")
        with Vertical(id="main"):
            yield GpuPanel(id="gpus")
            yield ProcessTable()
            # In a box of its own: Textual re-renders every widget whose *container* overlaps a
            # changed line, so as a sibling of the table it was drawn anew (0.7 ms) every time a
            # STEP moved.  Its box's region is its own: the table's lines no longer touch it.
            with Vertical(id="suggestions-box"):
                yield SuggestionsPane()
        yield Static(id="empty")
        # Made hidden up front, not on the first `/`: a widget mounted then takes focus only
        # after the keys already typed, and "/leak" typed fast sent its `k` to the kill binding.
        yield Input(
            placeholder="filter: pid, user, command, gpu0…  (enter keeps, esc clears)",
            id="filter",
            select_on_focus=True,
        )
        yield Static(id="status")
        yield Footer(compact=True)

    def get_driver_class(self) -> type[Driver]:
        """Textual's driver for this terminal; on Linux, one whose input thread sleeps until a
        key arrives (memtop.ui.quiet_driver).  MEMTOP_TEXTUAL_INPUT_POLL=1 keeps Textual's own."""
        driver = super().get_driver_class()
        linux = f"{driver.__module__}.{driver.__name__}" == LINUX_DRIVER
        if linux and not os.environ.get("MEMTOP_TEXTUAL_INPUT_POLL"):
            from memtop.ui.quiet_driver import QuietLinuxDriver

            return QuietLinuxDriver
        return driver

    def _install_cell_diff(self) -> None:
        """Only changed cells to the terminal (memtop.ui.cell_diff); not under a test pilot."""
        driver = self._driver
        if driver is None or self.is_headless or self.cell_diff is not None:
            return
        if os.environ.get("MEMTOP_NO_CELL_DIFF"):
            return
        from memtop.ui.cell_diff import install

        self.cell_diff, driver.write = install(driver.write)  # type: ignore[method-assign,assignment]

    def on_load(self) -> None:
        from memtop.ui.themes import apply_theme

        problems = list(self.config.problems)
        why = apply_theme(self, self.config.theme)
        if why:
            problems.append(why)
        keymap: dict[str, str] = {}
        if self.config.keys:
            known = {b.id for b in self._bindings_with_ids()}
            unknown = sorted(set(self.config.keys) - known)
            if unknown:
                problems.append(f"config: no binding with id {', '.join(unknown)} (see ? help)")
            keymap = {k: v for k, v in self.config.keys.items() if k in known}
            clashes = self._key_clashes(keymap)
            problems.extend(clashes.values())
            keymap = {k: v for k, v in keymap.items() if k not in clashes}
        if self.readonly and actions.acting(self.ACTIONS):
            keymap[actions.READONLY_ID] = ",".join(
                key
                for a in actions.acting(self.ACTIONS)
                for key in keymap.get(a.id, a.keys).split(",")
            )
        if keymap:
            self.set_keymap(keymap)
        self._config_problems = problems

    def get_key_display(self, binding: Binding) -> str:
        # (A keymap drops a binding's key_display: --readonly's stand-in is bound by keymap.)
        if binding.id == actions.READONLY_ID:
            return "·"
        return super().get_key_display(binding)

    def _key_clashes(self, keymap: dict[str, str]) -> dict[str, str]:
        """The user's bindings that would take a key another binding keeps (`cleanup = "q"`
        took q from quit): binding id → a one-line warning.  Those keep their default keys."""
        bindings = [b for b in self._bindings_with_ids() if b.id != actions.READONLY_ID]
        keys_of = {b.id: set(keymap.get(b.id or "", b.key).split(",")) for b in bindings}
        clashes: dict[str, str] = {}
        for binding_id in keymap:
            for other, keys in keys_of.items():
                taken = sorted(keys_of.get(binding_id, set()) & keys)
                if other != binding_id and taken:
                    clashes[binding_id] = (
                        f'config: keys.{binding_id} = "{keymap[binding_id]}" takes '
                        f"{', '.join(taken)} from {other}; {binding_id} keeps its default keys"
                    )
                    break
        return clashes

    def _bindings_with_ids(self) -> list[Binding]:
        return [
            b for b in (*self.BINDINGS, *ProcessTable.BINDINGS) if isinstance(b, Binding) and b.id
        ]

    def on_mount(self) -> None:
        # The collector was held for the start (memtop.base.start_gc): back once this frame is
        # out, the start's objects frozen (they live as long as the app).
        self.call_after_refresh(start_gc.release, freeze=True)
        # The widgets a refresh touches, looked up once rather than every second.
        self.header_bar = self.query_one("#header", Static)
        self.status_line = self.query_one("#status", Static)
        self.empty_state = self.query_one("#empty", Static)
        self.main_panels = self.query_one("#main")
        self.gpu_panel = self.query_one(GpuPanel)
        self.table = self.query_one(ProcessTable)
        self.suggestions = self.query_one(SuggestionsPane)
        self._install_cell_diff()
        self.filter_input = self.query_one("#filter", Input)
        self.gpu_panel.can_focus = False
        self.table.focus()  # focused already (DashboardScreen.AUTO_FOCUS): kept should that change
        # The table took the focus as the screen was composed, before the footer listened for
        # the screen's bindings: they are published for it now, as the focus's move from the
        # filter line to the table published them (the footer's keys come at the same frame).
        self.call_later(self.screen.refresh_bindings)
        for problem in self._config_problems:
            self.notify(problem, severity="warning", timeout=10)
        self._mounted = True
        self._view_size = self.size
        if self.before_first_frame is not None:
            self.before_first_frame()
            self.before_first_frame = None
        self.refresh_view()
        # Each round is drawn as soon as it lands (a message from the sampler thread), so the
        # frame never runs beside the next round; the timer only lets a status line expire
        # (and drives a store fed by something other than a sampler).
        self.set_interval(self.interval, self.refresh_view)
        self.feed.on_round = self._post_sampled
        self.call_after_refresh(self.feed.start)  # idempotent; after the first frame
        if self.feed.rounds == 0:
            # The first frame goes out before the first sampling round; look again as soon as
            # that round lands rather than a whole interval later.
            self._early = self.set_interval(0.05, self._refresh_when_sampled)
        else:
            # The usual start: the first round landed (and was painted) before Textual was
            # imported (memtop.commands.watch), so this first frame has its data.
            self._settle_gc_after_this_frame()

    def _post_sampled(self) -> None:
        self.post_message(Sampled())  # thread-safe

    def on_sampled(self, _: Sampled) -> None:
        self.refresh_view()

    def _refresh_when_sampled(self) -> None:
        if self.feed.rounds > 0:
            self._early.stop()
            self.refresh_view()
            self._settle_gc_after_this_frame()

    def _settle_gc_after_this_frame(self) -> None:
        """Start-up is over once the first frame with data is out: freeze what it made and give
        gen 0 its long-lived budget (_settle_gc)."""
        if not self.is_headless:  # the process is the dashboard's (not a test's)
            self.call_after_refresh(_settle_gc)

    def on_resize(self, event: events.Resize) -> None:
        if self.cell_diff is not None:
            self.cell_diff.forget()  # a resized terminal may have reflowed or cleared its screen
        # Built anew only at a new size: the driver's first Resize, just after the mount and
        # before the first frame, is of the size Textual gave before the mount, and rebuilt
        # every widget's figures for the frame they were just made for.
        if self._mounted and event.size != self._view_size:
            self._view_size = event.size
            self._generation = -1
            self.refresh_view()

    # ------------------------------------------------------------------ rendering

    def feed_still(self) -> bool:
        """The feed brings no later round for now (paused): the screen keeps this one."""
        return self.feed.still

    def refresh_view(self, exact: bool = False) -> None:
        """Render the newest observation, if anything was written since the last time.

        While rounds keep coming, the widgets show some figures anew only once per slow period
        (render.slow_tick: bytes over SSH); the next round renews them.  When no round will come
        (the feed is still) or the caller asks for `exact`, every figure is the round's own:
        a paused or ended feed must not keep a figure from an earlier round on screen.

        Whether the held figures are renewed is decided here, once, for every widget, card by
        card and row by row (memtop.ui.renewal): a suggestion worded anew and what it names, a
        card and the rows it sums, then always show one round's figures (a suggestion's
        "cached 31.2 GiB" beside a card's figures of another round was two values for one
        thing on one screen)."""
        if not self.screen_stack:
            return  # the app is closing: a timer tick that lands after the last screen left
        exact = exact or self.feed_still()
        generation = self.feed.generation
        if generation == self._generation and (self._exact or not exact):
            if self.dashboard is not None and self._event[0] and self._mounted:
                self._set(self.status_line, self._status(self.dashboard))  # let it expire
            return
        self._generation = generation
        self._exact = exact
        self.refreshes += 1
        whole = self.observer.latest()
        sampled = self.feed.rounds > 0
        observation = self.scope.apply(whole)
        self.observation = observation
        dash = view.build(
            observation, sampled=sampled, my_uid=self.my_uid, host=self.host, users=self._users
        )
        if self.scope and sampled:
            dash = self._scoped(dash, whole)
        self.dashboard = dash
        compact = self.size.width < COMPACT_WIDTH or self.size.height < COMPACT_HEIGHT
        dense = len(dash.gpus) * 2 > max(4, int(self.size.height * 0.3))
        if self._layout != (compact, dense):
            self._layout = (compact, dense)
            self.set_class(compact, "-compact")
        self._set(self.header_bar, self._header(dash))
        self._set(self.status_line, self._status(dash))
        empty = dash.state == view.EMPTY
        if self.main_panels.display == empty:  # only on a change: a set re-styles the widget
            self.main_panels.display = not empty
            self.empty_state.display = empty
        if empty:
            self._set(self.empty_state, _empty_text(dash))
        else:
            # (told every round, exact or not; a dense card prints no sums of its rows)
            renew = self.renewals.due(dash, compact, sums=not dense)
            if exact:
                renew = EVERYTHING
            self.gpu_panel.show(dash.gpus, dense, renew, no_gpus=dash.no_gpus)
            self.table.show(dash.processes, compact, renew, jobs=dash.jobs)
            self._show_suggestions(dash, compact, renew)
        detail = self._detail_screen()
        if detail is not None:
            self._show_detail(detail)
        gpu_screen = self._gpu_screen()
        if gpu_screen is not None:
            self._show_gpu(gpu_screen)

    def _show_suggestions(
        self, dash: view.Dashboard, compact: bool, renew: Renewal | bool | None
    ) -> None:
        """The suggestions about what the table shows: with a `/` filter on, those of the rows
        it keeps (a GPU-wide one, of their GPUs); `/gpu1` filtered the table, not the pane."""
        items, quiet = dash.suggestions, dash.quiet
        needle = self.table.filter
        if needle:
            pids = {row.pid for row in self.table.rows}
            gpus = {row.gpu for row in self.table.rows}
            items = tuple(
                item
                for item in items
                if (item.pid in pids if item.pid is not None else item.device in (None, *gpus))
            )
            hidden = len(dash.suggestions) - len(items)
            if not items:
                quiet = f"Nothing to suggest about the processes “{needle}” shows"
                quiet += f" ({hidden} about others)." if hidden else "."
        self.suggestions.show(items, compact, renew, quiet=quiet)

    def _set(self, widget: Static, content: Text) -> None:
        # Static.update repaints even when nothing changed; compare first.
        shown = (content.plain, content.spans)
        if self._shown.get(widget.id) != shown:
            self._shown[widget.id] = shown
            # A line whose size is its CSS's (the header's and the status line's height: 1)
            # is repainted alone: Static.update otherwise lays the whole screen out again and
            # redraws every widget, each time the status line says or drops something.
            widget.update(content, layout=widget.styles.auto_dimensions)

    def _header(self, dash: view.Dashboard) -> Text:
        """The host, what is read, the filter, and the badges (PAUSED; a replay's clock), all
        on one row: where the terminal is narrow, the interval, the source and the counts give
        way, never a badge or the filter (80 columns cut "PAUSED (p resumes)" to "PAUSED (p")."""
        text = Text.assemble((" memtop ", "bold black on cyan"), " ", (dash.host, "bold white"))
        gpus = f"{len(dash.gpus)} GPU{'s' if len(dash.gpus) != 1 else ''}"
        agents = f"{dash.agents} agent{'s' if dash.agents != 1 else ''}"
        every = f"every {self.interval:g} s"
        parts = [dash.source, *([self.scope.describe()] if self.scope else []), gpus, agents, every]
        badges = self._badges()
        room = self.size.width - text.cell_len - sum(len(badge) for badge, _ in badges)
        for gives_way in (every, dash.source, agents, gpus):
            if self.size.width <= 0 or len("  " + "  ·  ".join(parts)) <= room:
                break
            parts.remove(gives_way)
        text.append("  " + "  ·  ".join(parts), style=FREE)
        for badge, style in badges:
            text.append(badge, style=style)
        return text

    def _badges(self) -> list[tuple[str, str]]:
        """What the header must show whole, at its right."""
        if self.feed.paused:
            return [("   PAUSED (p resumes) ", "bold black on yellow")]
        return []

    def _scoped(self, dash: view.Dashboard, whole: Observation) -> view.Dashboard:
        """What a filter hides is not "nothing found": `--only 5` on a machine without a GPU 5
        says so, once as a warning and in the GPU pane, over the panels (not the empty state)."""
        if not self._scope_warned and whole.gpus:
            self._scope_warned = True  # once the GPUs are known
            for line in self.scope.missing(whole):
                self.notify(line, severity="warning", timeout=10)
        if dash.state == view.EMPTY and (whole.gpus or whole.agents):
            dash = replace(dash, state=view.READY)
        if self.scope.gpus is not None and not dash.gpus:
            chosen = ",".join(str(i) for i in sorted(self.scope.gpus))
            here = ", ".join(str(g.index) for g in whole.gpus)
            has = f"it has GPU {here}" if here else "no GPU is visible"
            dash = replace(dash, no_gpus=f"No GPU {chosen} on this machine ({has}): see --only.")
        return dash

    def _status(self, dash: view.Dashboard) -> Text:
        if dash.problems:
            return Text(" " + dash.problems[-1], style="bold red")
        if dash.nvml_error and dash.state != view.EMPTY and dash.no_gpus is None:
            # (Without a GPU card, the GPU pane says it in place of the cards.)
            return Text(f" {dash.nvml_error}", style="yellow")
        if dash.state == view.WAITING:
            return Text(" reading devices and agents…", style=FREE)
        # An event ("agent 4201 attached") is news for a few seconds, not a status.
        if dash.last_event != self._event[0]:
            self._event = (dash.last_event, time.monotonic())
        if dash.last_event and time.monotonic() - self._event[1] < EVENT_SHOW_S:
            return Text(" " + dash.last_event, style=FREE)
        return Text(" ")

    # ------------------------------------------------------------------ selection

    def _detail_screen(self) -> DetailScreen | None:
        # The screens' modules load on first use (the chart and its tables): the first frame
        # must not wait for them.
        detail = sys.modules.get("memtop.ui.screens.detail")  # None: no detail opened yet
        stack = self.screen_stack
        top = stack[-1] if stack else None  # empty while the app closes
        if detail is not None and isinstance(top, detail.DetailScreen):
            return top
        return None

    def selected_row(self) -> view.ProcessRow | None:
        detail = self._detail_screen()
        if detail is not None:
            return detail.row
        focused = self.focused
        if isinstance(focused, SuggestionsPane):
            item = focused.selected()
            if item is not None and item.pid is not None:
                return self._row_of(item.pid, item.device)
        return self.table.selected()

    def _row_of(self, pid: int, gpu: int | None) -> view.ProcessRow | None:
        rows = [r for r in (self.dashboard.processes if self.dashboard else ()) if r.pid == pid]
        exact = [r for r in rows if r.gpu == gpu]
        return (exact or rows)[0] if rows else None

    def _gpu_screen(self) -> GpuScreen | None:
        gpu = sys.modules.get("memtop.ui.screens.gpu")  # None: no GPU detail opened yet
        stack = self.screen_stack
        top = stack[-1] if stack else None
        if gpu is not None and isinstance(top, gpu.GpuScreen):
            return top
        return None

    def on_gpu_card_chosen(self, event: GpuCard.Chosen) -> None:
        """Enter on a GPU's card: its own detail, who holds its used bytes."""
        from memtop.ui.screens.gpu import GpuScreen

        screen = GpuScreen(event.uuid)
        self.push_screen(screen)
        self.call_after_refresh(self._show_gpu, screen)

    def _show_gpu(self, screen: GpuScreen) -> None:
        if self.observation is None or not screen.is_mounted:
            return
        try:
            screen.show(view.build_gpu_detail(self.observation, screen.uuid))
        except NoMatches:  # a round landed while the screen composes or closes
            return

    def on_process_table_row_chosen(self, event: ProcessTable.RowChosen) -> None:
        self._open_detail(event.row)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        item = self.suggestions.selected()
        if item is not None and item.pid is not None:
            row = self._row_of(item.pid, item.device)
            if row is not None:
                self._open_detail(row)

    def _open_detail(self, row: view.ProcessRow) -> None:
        from memtop.ui.screens.detail import DetailScreen

        screen = DetailScreen(row, self._gpu_uuid(row))
        self.push_screen(screen)
        self.call_after_refresh(self._show_detail, screen)

    def _gpu_uuid(self, row: view.ProcessRow) -> str | None:
        for gpu in self.dashboard.gpus if self.dashboard else ():
            # On a GPU in MIG mode, its instance's (they share the GPU's number).
            if gpu.index == row.gpu and gpu.gpu_instance == row.mig_instance:
                return gpu.uuid
        return None

    def _show_detail(self, screen: DetailScreen) -> None:
        if self.observation is None or not screen.is_mounted:
            return
        # Follow the process across refreshes (its step and state change; its key does not).
        current = {r.key: r for r in (self.dashboard.processes if self.dashboard else ())}
        row = current.get(screen.row.key, screen.row)
        try:
            screen.show(view.build_detail(self.observation, row, screen.gpu_uuid))
        except NoMatches:  # a round landed while the screen composes or closes: the next draws
            return

    # ------------------------------------------------------------------ actions

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # What each key may do where is its record's (memtop.ui.actions).
        behind_dialog = isinstance(self.screen, ModalScreen)
        # Read-only: the keys that act on a process leave the footer, "read-only" takes their
        # place, and their keys reach it instead (a binding whose check fails passes its key on).
        if action == "read_only":
            return self.readonly and not behind_dialog
        record = self.ACTION_OF.get(action)
        if record is None:
            return True
        # Behind a modal (help, confirmation) the dashboard's keys are asleep.
        if record.asleep_behind_dialogs and behind_dialog:
            return False
        if self.readonly and record.acts_on_process:
            return False
        # On the detail screen, keys that mean nothing there leave the footer (at 80 columns
        # it must show its last key, q Quit, whole).
        return record.on_detail or self._detail_screen() is None

    def _agent_target(self, verb: str, cuda: bool = False) -> view.ProcessRow | None:
        """The selected process if `verb` can be done in it; otherwise say why not.  `cuda`:
        the action works on CUDA's caching allocator, which a CPU-only process does not use."""
        row = self.selected_row()
        if row is None:
            self.notify("No process selected: move to one with ↑/↓.", severity="warning")
            return None
        if row.state == "exited":
            self.notify(f"pid {row.pid} has exited: nothing to {verb}.", severity="warning")
            return None
        if row.state == "no agent":
            self.notify(
                f"pid {row.pid} has no memtop agent, so memtop cannot {verb} in it. Press a "
                "to attach one, or start it with `memtop run` (or call memtop.start_agent() "
                "in it).",
                severity="warning",
                timeout=8,
            )
            return None
        if self.sampler is None:
            self.notify("This view is not live: it cannot act on processes.", severity="warning")
            return None
        if row.state != "agent":
            agent = self.observation.agent(row.pid) if self.observation else None
            why = agent.error if agent is not None and agent.error else row.state
            self.notify(f"Cannot reach the agent of pid {row.pid}: {why}", severity="error")
            return None
        if cuda and row.cpu_only:
            self.notify(
                f"pid {row.pid} uses no CUDA device (CPU only): nothing to {verb} — this key "
                "acts on CUDA's caching allocator. Its host memory is on the detail screen "
                "(enter).",
                severity="warning",
                timeout=8,
            )
            return None
        return row

    def _run_agent_command(
        self,
        row: view.ProcessRow,
        cmd: str,
        args: dict[str, Any],
        done: Callable[[view.ProcessRow, ActionReply], None],
    ) -> None:
        future = self.feed.act(row.pid, cmd, args, timeout=ACTION_TIMEOUT_S)

        def wait() -> None:
            try:
                reply = future.result(timeout=ACTION_TIMEOUT_S + 1)
            except concurrent.futures.TimeoutError:
                self.call_from_thread(self._failed, row, cmd, "no answer in time")
            except Exception as exc:  # a bug must not take the dashboard down
                self.call_from_thread(self._failed, row, cmd, f"{type(exc).__name__}: {exc}")
            else:
                if reply.error is not None:
                    self.call_from_thread(self._failed, row, cmd, reply.error)
                else:
                    self.call_from_thread(done, row, reply)

        self.run_worker(wait, thread=True, exit_on_error=False, group="actions")

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None:
        """Every notification of memtop is words, never markup: they carry what agents,
        drivers, fleet hosts and other users' processes say (an agent's error `try again [/x]
        later` raised MarkupError and ended root's dashboard).  The one place a notification is
        made: whatever a caller passes, the message is shown as it reads."""
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=False)

    def _failed(self, row: view.ProcessRow, cmd: str, why: str) -> None:
        self.notify(f"{cmd} in pid {row.pid} failed: {why}", severity="error", timeout=8)

    def action_read_only(self) -> None:
        self.notify(
            "Read-only (--readonly): memtop does not act on processes here "
            f"({actions.refused_words(self.ACTIONS)}).",
            severity="warning",
            timeout=5,
        )

    def action_cleanup(self) -> None:
        row = self._agent_target("clean up", cuda=True)
        if row is not None:
            self.notify(f"Cleaning up in pid {row.pid}…", timeout=2)
            self._run_agent_command(row, "cleanup", {}, self._cleanup_done)

    def _cleanup_done(self, row: view.ProcessRow, reply: ActionReply) -> None:
        cleanup = reply.parsed_as(AgentCleanup)
        lines = []
        for index, released in sorted(cleanup.released_bytes.items() if cleanup else ()):
            assert cleanup is not None
            before, after = cleanup.reserved_before.get(index), cleanup.reserved_after.get(index)
            lines.append(
                f"{self._gpu_name(row.pid, index)}: released {format_bytes(released)} "
                f"(reserved {format_bytes(before)} → {format_bytes(after)})"
            )
        if cleanup is None or not lines:  # the agent did nothing (and started no cooldown)
            lines.append("no CUDA device in use: nothing to clean up")
        else:
            lines.append(f"gc collected {cleanup.gc_collected or 0} objects")
        self.notify("\n".join(lines), title=f"Cleanup in pid {row.pid}", timeout=10)

    def _gpu_name(self, pid: int, index: str | int) -> str:
        """`GPU n` as the driver numbers it, for an agent's own device index."""
        for r in self.dashboard.processes if self.dashboard else ():
            if r.pid == pid and str(r.device) == str(index) and r.gpu is not None:
                return f"GPU {r.gpu}"
        return f"cuda:{index}"

    def action_reset_peak(self) -> None:
        row = self._agent_target("reset the peak")
        if row is not None:
            self._run_agent_command(row, "reset_peak", {}, self._reset_done)

    def _reset_done(self, row: view.ProcessRow, reply: ActionReply) -> None:
        # The feed restarted its sampled peak with torch's (memtop.engine.sampler.Sampler.act).
        reset = reply.parsed_as(AgentResetPeak)
        indices = reset.devices if reset is not None else ()
        devices = ", ".join(self._gpu_name(row.pid, i) for i in indices)
        self.notify(f"Peak reset in pid {row.pid} ({devices or 'no devices'}).", timeout=5)

    def action_snapshot(self) -> None:
        row = self._agent_target("take a snapshot", cuda=True)
        if row is None:
            return
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.clock()))
        # Never resolved: the agent's checks (no link, a new file) apply to the path it is given.
        path = self.snapshot_dir / f"memtop-snapshot-{row.pid}-{stamp}.pickle"
        self.notify(f"Writing a snapshot of pid {row.pid}…", timeout=2)
        self._run_agent_command(row, "snapshot", {"path": str(path)}, self._snapshot_done)

    def _snapshot_done(self, row: view.ProcessRow, reply: ActionReply) -> None:
        snapshot = reply.parsed_as(AgentSnapshot)
        path = snapshot.path if snapshot is not None else None
        self.notify(
            f"{path}\n{snapshot_note(snapshot.devices if snapshot is not None else {})}",
            title=f"Snapshot of pid {row.pid} written",
            timeout=15,
        )

    def action_terminate(self) -> None:
        row = self.selected_row()
        if row is None:
            self.notify("No process selected: move to one with ↑/↓.", severity="warning")
            return
        if row.state == "exited":
            self.notify(f"pid {row.pid} has already exited.", severity="warning")
            return
        info = self._process(row.pid)
        if info is None or not info.visible:
            self.notify(f"pid {row.pid} is not visible from here.", severity="error")
            return
        if info.uid != self.my_uid:
            self.notify(
                f"pid {row.pid} belongs to {info.user}: memtop terminates only your own processes.",
                severity="error",
            )
            return
        # Only a pid the driver lists, or whose agent passed authentication (SO_PEERCRED): a
        # socket named after a pid proves nothing about it.
        refusal = self.feed.may_signal(row.pid)
        if refusal is not None:
            self.notify(refusal, severity="error", timeout=8)
            return

        def answered(choice: object) -> None:
            sig = signal.SIGTERM if choice is True else choice
            if isinstance(sig, signal.Signals):
                self.run_worker(
                    lambda: self._terminate(row.pid, info, sig), thread=True, exit_on_error=False
                )

        from memtop.ui.screens.confirm import ConfirmScreen

        command = info.command
        self.push_screen(
            ConfirmScreen(
                f"Signal pid {row.pid}?",
                escape(command[:200]),  # an argv in markup: escaped
                choices=[(key, f"{name} ({key})", sig, what) for key, name, sig, what in SIGNALS],
            ),
            answered,
        )

    def _terminate(self, pid: int, info: Any, sig: signal.Signals = signal.SIGTERM) -> None:
        reply = self.feed.signal(pid, sig, expected=info)  # checks again, just before it
        if reply.error is not None:
            self.call_from_thread(self.notify, reply.error, severity="error")
        else:
            self.call_from_thread(self.notify, reply.message)

    def _process(self, pid: int) -> Any:
        """The owner and command of `pid` as the screen shows them (its ProcessInfo)."""
        return self.observation.processes.get(pid) if self.observation is not None else None

    def action_stacks(self) -> None:
        """Stack recording on or off in the selected trainer (asks first, says the cost):
        the `sites` command, switched by the trainer at its next step boundary."""
        row = self._agent_target("record stacks", cuda=True)
        if row is None:
            return

        def answered(choice: object) -> None:
            if isinstance(choice, bool):
                done = self._stacks_on if choice else self._stacks_off
                self._run_agent_command(row, "sites", {"stacks": choice}, done)

        from memtop.ui.screens.confirm import ConfirmScreen

        self.push_screen(
            ConfirmScreen(
                f"Record allocation stacks in pid {row.pid}?",
                actions.STACKS_COST,
                choices=[
                    ("y", "On (y)", True, "who holds the memory, by line (detail screen)"),
                    ("o", "Off (o)", False, "stop recording; torch forgets the stacks"),
                ],
            ),
            answered,
        )

    def action_expandable_segments(self) -> None:
        """Expandable segments on in the selected trainer (asks first: the exact setting
        before and after, that cached segments keep their kind, how to undo): the `tune`
        command, run by the trainer at its next step boundary."""
        row = self._agent_target("change allocator settings")
        if row is None:
            return
        agent = self.observation.agent(row.pid) if self.observation else None
        before = agent.settings_in_force if agent is not None else ""
        undo = f"memtop tune {row.pid} expandable_segments=False"
        if alloc_conf.parse(before).expandable_segments:
            self.notify(
                f"pid {row.pid} already runs with expandable segments ({before}). Undo: {undo}",
                timeout=8,
                markup=False,
            )
            return
        after = alloc_conf.with_options(before, {"expandable_segments": "True"})

        def answered(choice: object) -> None:
            if isinstance(choice, bool):
                args: dict[str, Any] = {"set": {"expandable_segments": True}}
                if choice:
                    args["empty_cache"] = True
                self._run_agent_command(row, "tune", args, self._tune_done)

        from memtop.ui.screens.confirm import ConfirmScreen

        self.push_screen(
            ConfirmScreen(
                f"Expandable segments in pid {row.pid}?",
                escape(
                    f"{before or '(default)'} → {after}\n{actions.EXPANDABLE_SEGMENTS_EFFECT}\n"
                    f"Undo: {undo}"
                ),  # the trainer's own string, in markup: escaped
                choices=[
                    ("y", "Apply (y)", False, "new segments expandable; cached ones stay"),
                    ("e", "Apply+empty (e)", True, "free cached segments go back now"),
                ],
            ),
            answered,
        )

    def _tune_done(self, row: view.ProcessRow, reply: ActionReply) -> None:
        tune = reply.parsed_as(AgentTune)
        if tune is None:
            return
        when = f"after step {tune.after_step}" if tune.after_step is not None else "at a step"
        lines = [f"{tune.before or '(default)'} → {tune.after or '(default)'} ({when})"]
        for index, before in sorted(tune.reserved_before.items()):
            after = tune.reserved_after.get(index, 0)
            lines.append(
                f"{self._gpu_name(row.pid, index)}: cache emptied, reserved "
                f"{format_bytes(before)} → {format_bytes(after)}"
            )
        self.notify(
            "\n".join(lines),
            title=f"Allocator settings of pid {row.pid}",
            timeout=12,
            markup=False,  # the trainer's own string
        )

    # The feed asks the agent's sites again at once (memtop.engine.sampler.Sampler.act).
    def _stacks_on(self, row: view.ProcessRow, reply: ActionReply) -> None:
        said = (
            f"Stack recording asked in pid {row.pid}: it starts at the trainer's next "
            "step; the detail screen (enter) shows who holds the memory."
        )
        self.notify(said, timeout=8)

    def _stacks_off(self, row: view.ProcessRow, reply: ActionReply) -> None:
        self.notify(f"Stack recording stops in pid {row.pid} at its next step.", timeout=8)

    def action_attach(self) -> None:
        """Start memtop's agent inside the selected process, which has none yet (asks first)."""
        row = self.selected_row()
        if row is None:
            self.notify("No process selected: move to one with ↑/↓.", severity="warning")
            return
        agent = self.observation.agent(row.pid) if self.observation else None
        if row.state != "no agent" or agent is not None:
            what = "has exited" if row.state == "exited" else "already has a memtop agent"
            self.notify(f"pid {row.pid} {what}.", severity="warning")
            return
        if self.sampler is None:
            self.notify("This view is not live: it cannot act on processes.", severity="warning")
            return
        info = self._process(row.pid)
        if info is None or not info.visible:
            self.notify(f"pid {row.pid} is not visible from here.", severity="error")
            return
        if info.uid != self.my_uid and self.my_uid != 0:
            self.notify(
                f"pid {row.pid} belongs to {info.user}: attach as that user (or root).",
                severity="error",
            )
            return

        def answered(yes: object) -> None:
            if yes is True:
                self.notify(f"Attaching to pid {row.pid}…", timeout=3)
                self.run_worker(
                    lambda: self._attach_agent(row.pid, info.uid),
                    thread=True,
                    exit_on_error=False,
                    group="actions",
                )

        from memtop.ui.screens.confirm import ConfirmScreen

        # Root about to run code in another user's process: the question says whose it is.
        # Another user's argv and name go into markup: escaped ("[/x]" in an argv raised
        # MarkupError and took root's dashboard down).
        user = escape(str(info.user))
        whose = (
            f"It belongs to {user} (uid {info.uid}), not to you (root); its agent runs as {user}.\n"
            if info.uid != self.my_uid
            else ""
        )
        self.push_screen(
            ConfirmScreen(
                f"Attach memtop to pid {row.pid}"
                + (f" of {user}?" if info.uid != self.my_uid else "?"),
                f"{escape(info.command[:200])}\n{whose}It is paused a moment (gdb / ptrace) "
                "while one line of Python starts memtop's agent thread inside it.",
            ),
            answered,
        )

    def _attach_agent(self, pid: int, consent_uid: int | None) -> None:
        # A worker thread: gdb takes seconds; the sampler finds the new socket by itself.
        # consent_uid: the owner the dialog named; attach refuses a pid another user reused.
        from memtop.engine.attach import AttachError, attach

        try:
            message = attach(pid, consent_uid=consent_uid).message
        except AttachError as exc:
            self.call_from_thread(self.notify, str(exc), severity="error", timeout=10)
        except Exception as exc:  # a bug must not take the dashboard down
            self.call_from_thread(
                self.notify, f"attach: {type(exc).__name__}: {exc}", severity="error"
            )
        else:
            self.call_from_thread(self.notify, message, timeout=8)

    def action_pause(self) -> None:
        if self.sampler is None:
            return
        self.feed.pause(not self.feed.paused)
        self._generation = -1
        self.refresh_view()
        self.notify("Sampling paused." if self.feed.paused else "Sampling resumed.", timeout=2)

    def action_copy_fix(self) -> None:
        """Copy a fix (OSC 52: works over SSH in most terminals): the focused suggestion's; from
        the table or the detail screen, the selected process's most severe suggestion's — never
        another process's, nor a lesser tip's when that one has none (a leak's `y` copied the
        8-bit optimizer).  Only a command shown in full is copied (memtop.ui.fixes)."""
        pane = self.suggestions
        if self.focused is pane and self._detail_screen() is None:
            item = pane.selected()
            if item is None:
                self.notify("No suggestion highlighted.", severity="warning")
                return
        else:
            row = self.selected_row()
            if row is None:
                self.notify("No process selected: move to one with ↑/↓.", severity="warning")
                return
            mine = self._items_of(row)
            if not any(i.fix for i in mine):
                self.notify(f"No suggestion for pid {row.pid} has a fix.", severity="warning")
                return
            item = mine[0]  # most severe first
        refusal = fixes.not_copied(item)
        if refusal is not None:
            self.notify(refusal, severity="warning", timeout=6)
            return
        self.copy_to_clipboard(item.fix or "")
        self.notify(fixes.copied(item), timeout=6)

    def _items_of(self, row: view.ProcessRow) -> list[view.SuggestionItem]:
        """The selected process's own suggestions, most severe first, unfolded (the pane folds
        a process's tips into one item that has no single fix)."""
        if self.observation is None:
            return []
        return [
            view.suggestion_item(s)
            for s in self.observation.diagnosis.suggestions_for(row.pid)
            if s.device is None or row.device is None or s.device == row.device
        ]

    def action_filter(self) -> None:
        if self._detail_screen() is not None:
            return
        self.filter_input.display = True
        self.filter_input.value = self.table.filter
        # At once, not at Widget.focus's later turn: the keys typed right after `/` are already
        # queued, and they are the filter's, not the dashboard's bindings (`k` kills, `c` cleans
        # up inside the trainer).
        self.screen.set_focus(self.filter_input)

    def on_input_changed(self, event: Any) -> None:
        if event.input is self.filter_input:
            self.table.set_filter(event.value)
            self._refilter_suggestions()

    def on_input_submitted(self, event: Any) -> None:
        if event.input is self.filter_input:
            self._close_filter(keep=True)

    def _refilter_suggestions(self) -> None:
        dash = self.dashboard
        if dash is not None and dash.state != view.EMPTY and self._mounted:
            compact = self.size.width < COMPACT_WIDTH or self.size.height < COMPACT_HEIGHT
            self._show_suggestions(dash, compact, renew=True)

    def _close_filter(self, keep: bool) -> None:
        if not keep:
            self.table.set_filter("")
            self._refilter_suggestions()
        self.filter_input.display = False
        self.table.focus()

    def on_key(self, event: Any) -> None:
        if self.focused is not self.filter_input:
            return
        if event.key == "escape":
            event.stop()
            self._close_filter(keep=False)
        elif event.is_printable:
            # A letter the filter line did not take itself: typed (or pasted) right after `/`,
            # it was sent to the table before the line had focus and came back up here. It is
            # the filter's, not a binding's ("/leak" fast opened the kill dialog; `c`, `r`, `s`
            # act inside a trainer). Queued behind the line's focus, so it lands in order.
            event.stop()
            event.prevent_default()
            self.filter_input.post_message(events.Key(event.key, event.character))

    def action_help(self) -> None:
        from memtop.ui.screens.help import HelpScreen

        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())


# Python's default gen-0 threshold (700) makes Textual and the observation pay a collection
# every ~0.8 s, and a full one (all of Textual's ~70k start-up objects) every few seconds: 71 ms
# of GC in 30 s measured, ~13 % of the dashboard's CPU. Start-up's objects live as long as the
# app, so they are frozen out of every collection; and a larger gen-0 budget lets a frame's
# short-lived objects die by reference count before any collection looks at them (1 gen-0
# collection, 4.5 ms, in the same 30 s).
GC_GEN0_THRESHOLD = 10_000


def _settle_gc() -> None:
    """Once start-up is over (the first frame with data is out)."""
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


def _empty_text(dash: view.Dashboard) -> Text:
    text = Text()
    text.append("No GPUs and no PyTorch processes found.\n\n", style="bold")
    if dash.nvml_error:
        text.append(f"{dash.nvml_error}\n\n", style="yellow")
    for problem in dash.problems:
        text.append(f"{problem}\n\n", style="red")
    text.append("To watch a training run, start it with the agent:\n\n")
    text.append("    memtop run train.py --your-args\n\n", style="bold cyan")
    text.append("or try memtop on simulated GPUs with leaking and fragmenting trainers:\n\n")
    text.append("    memtop demo\n\n", style="bold cyan")
    text.append("memtop keeps looking; anything that appears shows up here.", style=FREE)
    return text
