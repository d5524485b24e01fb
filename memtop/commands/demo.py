"""`memtop demo`: simulated GPUs and trainers, then the dashboard (or only the trainers)."""

from __future__ import annotations

import argparse
import contextlib
import sys

from memtop.base import children
from memtop.base.errors import MemtopError
from memtop.commands import EXIT_OK, common
from memtop.commands.common import TERMINAL_FD
from memtop.commands.watch import paint_header, watch


class DemoUsageError(MemtopError):
    """A flag's value the demo cannot use: one line, exit 2 (as argparse's usage errors)."""

    exit_code = 2


def run(args: argparse.Namespace) -> int:
    from memtop import protocol
    from memtop.sim import demo as demo_module
    from memtop.sim.demo import Demo

    gpus = args.gpus if args.gpus is not None else (2 if args.scenario == "mixed" else 1)
    if not 1 <= gpus <= demo_module.MAX_GPUS:  # before any trainer starts: a usage error
        raise DemoUsageError(demo_module.gpus_problem(gpus))
    # The trainers would refuse an unsafe socket directory one by one: say it once, up front.
    protocol.ensure_socket_dir(args.socket_dir)
    # With the dashboard, the trainers' messages go to a log: on its terminal they would be
    # drawn over it.
    dashboard = not args.no_ui and common.on_a_terminal()
    try:
        demo = Demo(
            gpus,
            args.scenario,
            args.step_time,
            socket_dir=args.socket_dir,
            log_messages=dashboard,
            vendor=args.vendor,
        )
    except ValueError as exc:
        raise MemtopError(str(exc)) from None
    # SIGTERM and SIGHUP (`--no-ui` in a terminal that closes) unwind as Ctrl-C does: the
    # trainers are stopped and the simulated GPUs removed here, not left to the trainers' watch
    # on their parent.  The dashboard's driver takes both over once it runs, and honours one
    # that came before (children.stop_requested).
    signals = contextlib.ExitStack()
    signals.enter_context(children.interrupted_by_signals())
    painted = False
    try:
        # The trainers take a few seconds to start: the header says memtop is on its way
        # meanwhile.
        if dashboard:
            from memtop.ui import config

            painted = paint_header(config.load())
        pids = demo.start()
        if not demo.wait_ready():
            raise MemtopError(f"simulated trainers failed to start (exited: {demo.failed()})")
        if args.no_ui:
            print(
                f"memtop demo: {len(pids)} simulated trainer(s) ({args.scenario}) on {gpus} "
                f"simulated GPU(s): pids {' '.join(map(str, pids))}. Ctrl-C stops them.",
                flush=True,
            )
            while not children.wait_for_stop(0.5):
                if demo.failed():
                    raise MemtopError(f"simulated trainer(s) exited: {demo.failed()}")
            return EXIT_OK
        args.interval = args.interval or 1.0
        return watch(args, simulated_only=True, painted=painted)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        signals.close()  # the handlers as they were; a trainer this misses ends with us (--parent)
        demo.stop()
        if not args.no_ui:  # an error above is printed on the normal screen, not lost with it
            from memtop.ui import splash

            splash.restore(TERMINAL_FD)  # a no-op unless the header was painted
        said = demo.log_summary()
        if said:
            print(said, file=sys.stderr)
