"""The subcommands, one module each; `memtop.cli` parses (memtop.commands.parser) and
dispatches through `COMMANDS`.

Each module's `run(args)` runs its command and returns the exit code; a `MemtopError` it raises
is printed by the CLI as one line (exit code 1, or the error's own).  A module is imported only
when its command runs (the start-up budget, DESIGN §9).

May import anything below it: the engine, the presenters, the UI, the exporter, the sources.
Imported by `memtop.cli` only.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

from memtop.base.errors import MemtopError

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2

# The old names of the one-line error (memtop.cli's CliError is the same class).
CommandError = MemtopError

# Subcommand -> the module that runs it (`memtop run` is dispatched before argparse).
COMMANDS = {
    "demo": "memtop.commands.demo",
    "cleanup": "memtop.commands.actions",
    "snapshot": "memtop.commands.actions",
    "tune": "memtop.commands.tune",
    "replay": "memtop.commands.replay",
    "record": "memtop.commands.record",
    "attach": "memtop.commands.attach",
    "estimate": "memtop.commands.estimate",
    "oom": "memtop.commands.oom",
    "export": "memtop.commands.export",
    "report": "memtop.commands.report",
    "compare": "memtop.commands.compare",
}


def runner(command: str) -> Callable[[argparse.Namespace], int]:
    """The `run(args)` of a subcommand's module (imported now)."""
    module = importlib.import_module(COMMANDS[command])
    run: Callable[[argparse.Namespace], int] = module.run
    return run
