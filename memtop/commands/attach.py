"""`memtop attach PID`: the command line of memtop.attach."""

from __future__ import annotations

import argparse

from memtop.commands import CommandError


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    attach = sub.add_parser(
        "attach", help="start the agent inside a running Python process (gdb or sys.remote_exec)"
    )
    attach.add_argument("pid", type=int)
    attach.add_argument(
        "--wait",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long to wait for the agent to answer (default 10)",
    )


def run(args: argparse.Namespace) -> int:
    from memtop.attach import AttachError, attach

    if args.wait <= 0:
        raise CommandError("--wait must be greater than 0")
    try:
        print(attach(args.pid, wait=args.wait).message)
    except AttachError as exc:
        raise CommandError(str(exc)) from None
    return 0
