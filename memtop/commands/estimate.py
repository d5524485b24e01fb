"""`memtop estimate`: will a training run fit (memtop.estimate.command), with `--from PID`
asking a live agent's figures as `memtop cleanup` asks."""

from __future__ import annotations

import argparse
from pathlib import Path

from memtop.base.errors import MemtopError
from memtop.commands.actions import agent_action


def run(args: argparse.Namespace) -> int:
    from memtop import protocol
    from memtop.estimate import command

    source = getattr(args, "from_recording", None)
    pid = protocol.decimal(source) if source is not None else None
    if pid is not None:
        # `--from PID`: a number is a live agent's pid, whatever files lie here (a file of
        # that name is `./PID`): its figures, asked as `memtop cleanup` asks (same checks).
        try:
            sample = agent_action(pid, "sample", {}, None)
            breakdown = agent_action(pid, "breakdown", {"wait_s": 10.0}, None)
        except MemtopError as exc:
            if Path(str(source)).exists():
                raise MemtopError(f"{exc} (for the file {source}, say ./{source})") from None
            raise
        args.live_replies = (pid, sample, None if breakdown.get("pending") else breakdown)
    return command.run(args)  # its errors are MemtopErrors (a usage error's exit code is 2)
