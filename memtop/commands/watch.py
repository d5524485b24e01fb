"""`memtop` with no subcommand: the dashboard on a terminal, a refreshing text report on a pipe,
or one report with `--once [--json]`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from memtop.base import children, start_gc
from memtop.commands import EXIT_OK, common
from memtop.commands.common import TERMINAL_FD

if TYPE_CHECKING:
    from memtop.engine.observation import Observation
    from memtop.engine.scope import Scope
    from memtop.model import DriverReading
    from memtop.ui.config import UiConfig

ONCE_EXTRA_ROUNDS = 6
ONCE_ROUND_GAP_S = 0.05
# --once waits at most this long for agents in all (a stopped or hostile agent included), then
# reports whatever answered; each agent request has its own deadline within it.  One whose first
# request a loaded box started late is waited for until that request's own deadline.
ONCE_BUDGET_S = 1.5
ONCE_EXTRA_ROUND_S = 0.15
# How long the dashboard's start waits, in all, for the first round: for the driver's reading
# before Textual is imported, then for the agents' answers before Textual's first frame (each is
# painted as it lands; Textual imports and starts meanwhile); a round that takes longer (a hung
# agent) is drawn by Textual when it lands.
FIRST_ROUND_WAIT_S = 0.3


def once(args: argparse.Namespace) -> int:
    from memtop.engine.observation import Observer
    from memtop.present import report

    sampler = common.make_sampler(args)
    deadline = time.monotonic() + ONCE_BUDGET_S
    try:
        sampler.sample_once()
        # The fragmentation gauge swings within a step; with agents attached, a few quick
        # rounds let the report judge its median rather than one mid-step reading.
        for _ in range(ONCE_EXTRA_ROUNDS if sampler.store.agents() else 0):
            left = deadline - time.monotonic() - ONCE_ROUND_GAP_S
            if left <= 0.02:
                break
            time.sleep(ONCE_ROUND_GAP_S)
            sampler.sample_once(budget=min(ONCE_EXTRA_ROUND_S, left))
        if sampler.agents.unanswered():
            # An agent still answering its first request has no row yet.  Each request ends by
            # its own deadline, within the budget on a quiet box; a loaded one starts it late,
            # and the report left a silent agent out instead of calling it hung.  One more
            # round waits for those requests: a second at most.
            sampler.sample_once(budget=sampler.agents.timeout)
        scope = common.scope(args)
        whole = Observer(sampler.store).latest()
        for line in scope.missing(whole):
            print(f"memtop: warning: {line}", file=sys.stderr)
        data = scoped_report(scope, whole)
    finally:
        sampler.stop()
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        sys.stdout.write(report.render_text(data))
    return EXIT_OK


def scoped_report(scope: Scope, whole: Observation) -> dict[str, Any]:
    """The report of what `scope` shows, with `filtered_out`: what it hid, in one line (None
    when it hid nothing), which the text says instead of "no GPUs and no agents found"."""
    from memtop.present import report

    shown = scope.apply(whole)
    data = report.build(shown)
    data["filtered_out"] = scope.hidden(whole, shown)
    return data


def _first_round_wait_s() -> float:
    """FIRST_ROUND_WAIT_S, or MEMTOP_FIRST_ROUND_WAIT_S (seconds, at most 30) where a slow or
    loaded machine (a test on a busy CI box) would rather wait for the first figures."""
    text = os.environ.get("MEMTOP_FIRST_ROUND_WAIT_S", "")
    try:
        value = float(text) if text.isascii() else FIRST_ROUND_WAIT_S
    except ValueError:
        return FIRST_ROUND_WAIT_S
    return min(30.0, value) if value >= 0 else FIRST_ROUND_WAIT_S


def _terminal_size() -> tuple[int, int]:
    try:
        size = os.get_terminal_size(TERMINAL_FD)
    except OSError:
        return 80, 24
    return size.columns, size.lines


def watch(args: argparse.Namespace, simulated_only: bool, painted: bool = False) -> int:
    """The dashboard on a terminal; the plain text view when stdout is not one.  `painted`: the
    header is on screen already (`memtop demo` paints it while its trainers start)."""
    if common.on_a_terminal():
        # Until the dashboard's driver takes them over, SIGTERM and SIGHUP unwind as Ctrl-C
        # does: the terminal is given back (the header may be painted already).
        with children.interrupted_by_signals():
            return _dashboard(args, simulated_only, painted)
    return _text_view(args, simulated_only)


def paint_header(settings: UiConfig) -> bool:
    """The dashboard's header row on the terminal before Textual is imported (start-up budget,
    DESIGN §9); whether it was painted (memtop.ui.splash)."""
    from memtop.ui import splash

    return splash.paint(TERMINAL_FD, colour=settings.theme != "monochrome")


def _dashboard(args: argparse.Namespace, simulated_only: bool, painted: bool = False) -> int:
    from memtop.ui import config, splash

    settings = config.load()
    alerts = None
    try:
        if not painted:
            paint_header(settings)
        from memtop.ui.start import import_asyncio_without_tls, one_malloc_arena

        one_malloc_arena()  # before any thread of ours: ~3 MB of part-empty arenas
        sampler = common.make_sampler(args, simulated_only)
        try:
            # The start-up budget (DESIGN §9): the first round starts before anything else is
            # imported.  The driver's reading comes first (the GPUs' rows go on screen under the
            # header at once, splash.driver_lines); the agents answer while the observer and
            # then Textual (~0.4 s of CPU) are imported; that round's figures are painted when
            # it lands, and Textual's first frame draws the same observation (the app takes
            # `on_round` over).
            scope = common.scope(args)
            size = _terminal_size()
            driver_shown = threading.Event()

            def on_first_reading(reading: DriverReading) -> None:
                sampler.on_reading = None
                splash.paint_figures(TERMINAL_FD, splash.driver_lines(reading, size[0], scope))
                driver_shown.set()

            sampler.on_reading = on_first_reading
            sampler.start()
            wait_until = time.monotonic() + _first_round_wait_s()
            # The GPUs' rows first: an import meanwhile (the observer's, Textual's) would hold the
            # interpreter between each of the read's system calls.
            driver_shown.wait(max(0.0, wait_until - time.monotonic()))
            from memtop.engine.observation import Observer

            observer = Observer(sampler.store)
            # Each run's line goes where the dashboard shows events (stderr is Textual's).
            alerts = common.alerts(args, observer, sampler.store.note)
            first_round = threading.Event()
            paint_once = threading.Lock()

            def paint_first_round(observation: Observation) -> None:
                with paint_once:
                    if first_round.is_set():
                        return
                    first_round.set()
                lines = splash.figure_lines(observation, *size, scope)
                splash.paint_figures(TERMINAL_FD, lines)

            def on_round() -> None:
                paint_first_round(observer.publish())

            sampler.on_round = on_round
            if sampler.rounds:  # the round landed before its hook was set
                paint_first_round(observer.latest())

            def before_first_frame() -> None:
                # Run by the app where its first frame is drawn (on_mount), so that Textual
                # starts (driver, CSS, mount) while the agents answer: the first round's figures
                # stay the splash's to paint until then, and the first frame draws them when
                # they are that close (a hung agent is drawn by Textual when its round lands).
                first_round.wait(max(0.0, wait_until - time.monotonic()))
                splash.hand_over()

            import_asyncio_without_tls()  # before Textual: 4 MB of OpenSSL it never uses
            from memtop.ui.app import MemtopApp

            app = MemtopApp(
                sampler.store,
                sampler,
                interval=args.interval,
                scope=scope,
                config=settings,
                readonly=getattr(args, "readonly", False) or settings.readonly,
                observer=observer,
                before_first_frame=before_first_frame,
            )
            app.run()
        finally:
            sampler.stop()
            if alerts is not None:
                alerts.close()
    finally:
        # Textual leaves the alternate screen when it ran; when it never got that far (an
        # error or Ctrl-C while importing, even one that lands as the header is written) this
        # gives the terminal back.  Twice is harmless; without a header it does nothing.
        splash.restore(TERMINAL_FD)
    return EXIT_OK


def _log_line(line: str) -> None:
    print(f"memtop: {line}", file=sys.stderr, flush=True)


def _text_view(args: argparse.Namespace, simulated_only: bool) -> int:
    """A plain refreshing text report, for a pipe or a log file."""
    start_gc.release()  # held for the dashboard's start only
    from memtop.engine.observation import Observer
    from memtop.present import report

    sampler = common.make_sampler(args, simulated_only)
    sampler.start()
    observer = Observer(sampler.store)  # one for the run: it keeps the leak verdicts
    alerts = common.alerts(args, observer, _log_line)
    interactive = sys.stdout.isatty()
    scope = common.scope(args)
    warned = False
    try:
        while True:
            time.sleep(min(args.interval, 0.5) if sampler.rounds == 0 else args.interval)
            whole = observer.latest()
            if not warned and whole.gpus:
                warned = True
                for line in scope.missing(whole):
                    print(f"memtop: warning: {line}", file=sys.stderr, flush=True)
            data = scoped_report(scope, whole)
            text = report.render_text(data)
            if interactive:
                sys.stdout.write("\x1b[H\x1b[2J" + text + "\n(Ctrl-C to quit)\n")
            else:
                sys.stdout.write(text + "\n")
            sys.stdout.flush()
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        sampler.stop()
        if alerts is not None:
            alerts.close()
