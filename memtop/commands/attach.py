"""`memtop attach PID`: the command line of memtop.engine.attach."""

from __future__ import annotations

import argparse
import sys

from memtop.base.errors import MemtopError


def add_arguments(attach: argparse.ArgumentParser) -> None:
    """`memtop attach`'s arguments (its name and help are in memtop.commands.parser)."""
    attach.add_argument("pid", type=int)
    attach.add_argument(
        "--wait",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long to wait for the agent to answer (default 10)",
    )
    attach.add_argument(
        "--stacks",
        action="store_true",
        help="then record allocation stacks in it (who holds the memory, by line; as `w` does)",
    )
    attach.add_argument(
        "--yes",
        action="store_true",
        help="as root, attach to another user's process without asking (it asks y/N otherwise)",
    )


def run(args: argparse.Namespace) -> int:
    from memtop.engine.attach import (
        attach,
        consent_question,
        consent_refusal,
        read_target,
        record_stacks,
    )

    if args.wait <= 0:
        raise MemtopError("--wait must be greater than 0")
    # An AttachError is a MemtopError: said in one line by the CLI.
    target = read_target(args.pid)
    if target.foreign and not args.yes:
        # Root about to pause another user's process and run code in it: say whose it is
        # and ask; without a terminal to ask on, refuse (a script says --yes).
        if not sys.stdin.isatty():
            raise MemtopError(consent_refusal(target))
        print(consent_question(target), end="", file=sys.stderr, flush=True)
        try:
            answer = sys.stdin.readline(16)
        except (OSError, UnicodeDecodeError):
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            raise MemtopError(f"not attached to pid {args.pid}")
    print(attach(args.pid, wait=args.wait, consent_uid=target.uid).message)
    if args.stacks:
        print(record_stacks(args.pid))
    return 0
