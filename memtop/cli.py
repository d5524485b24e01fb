"""Command line: argument parsing and dispatch only (DESIGN §7).

The parser is memtop.commands.parser; each subcommand runs in its module under memtop.commands
(the table `COMMANDS`).  Exit codes: 0 ok, 1 error (one line on stderr: any MemtopError), 2
usage.  Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence

from memtop.base import start_gc
from memtop.base.errors import MemtopError
from memtop.commands import EXIT_ERROR, EXIT_OK, EXIT_USAGE, runner
from memtop.commands.common import make_sampler, scope
from memtop.commands.parser import build_parser
from memtop.protocol import UnsafeSocketDir

# The old names, kept for the callers that import them from here (tests, scripts).
CliError = MemtopError
_make_sampler, _scope = make_sampler, scope
__all__ = ["EXIT_ERROR", "EXIT_OK", "EXIT_USAGE", "CliError", "build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    start_gc.hold()  # `python -m memtop` and `memtop` held it already (memtop/__main__.py)
    try:
        return _main(argv)
    except BrokenPipeError:
        # `memtop | head -1`: the reader left.  End quietly, as `cat` would, and keep Python's
        # final flush of stdout from raising again.
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    finally:
        start_gc.release()


def _main(argv: Sequence[str] | None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "run":
        from memtop.commands import run

        start_gc.release()
        return run.main(args_list[1:])
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.json and not args.once and args.command is None:
        parser.error("--json needs --once")
    if args.command is not None or args.prometheus or args.once:
        start_gc.release()  # held only for the dashboard's start (memtop.commands.watch)
    try:
        if args.command is not None:
            return runner(args.command)(args)
        if args.prometheus:
            if scope(args):  # said, not silently ignored
                raise MemtopError("--only, --user and --pid do not apply to --prometheus (yet)")
            from memtop.commands import fleet

            return fleet.run(args)
        from memtop.commands import watch

        if args.once:
            return watch.once(args)
        return watch.watch(args, simulated_only=False)
    except (MemtopError, UnsafeSocketDir) as exc:
        print(f"memtop: {exc}", file=sys.stderr)
        return exc.exit_code if isinstance(exc, MemtopError) else EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
