"""`memtop run [--] script.py args | memtop run -m module args`: a Python program with the agent
(parsed here, before argparse: everything after the program is the program's)."""

from __future__ import annotations

import os
import sys

from memtop.commands import EXIT_ERROR, EXIT_OK, EXIT_USAGE


def main(rest: list[str]) -> int:
    usage = (
        "usage: memtop run [--auto-cleanup] [--stacks] [--] script.py [args...] | "
        "memtop run [--auto-cleanup] [--stacks] -m module [args...]"
    )
    # The options, in any order, before the program; the environment carries them to the
    # ranks this program starts (their agents read it too).
    options = {
        # gc + empty_cache at a step boundary when a GPU is >= 95 % full
        "--auto-cleanup": "MEMTOP_AUTO_CLEANUP",
        # record each live block's allocating stack from the first step (the `sites`)
        "--stacks": "MEMTOP_STACKS",
    }
    while rest and rest[0] in options:
        os.environ[options[rest[0]]] = "1"
        rest = rest[1:]
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest or rest[0] in ("-h", "--help"):
        print(usage, file=sys.stdout if rest else sys.stderr)
        return EXIT_OK if rest else EXIT_USAGE
    from memtop.agent.launcher import LaunchError, run_program

    if rest[0] == "-m":
        if len(rest) < 2:
            print(usage, file=sys.stderr)
            return EXIT_USAGE
        target, args, as_module = rest[1], rest[2:], True
    else:
        target, args, as_module = rest[0], rest[1:], False
    try:
        return run_program(target, args, as_module)
    except LaunchError as exc:
        # Python's own one line (and exit code) for a target it cannot run.
        print(f"memtop run: {exc}", file=sys.stderr)
        return exc.code
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return EXIT_OK
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return EXIT_ERROR
