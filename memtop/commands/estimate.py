"""`memtop estimate`: will a training run fit (memtop.estimate.command), with `--from PID`
asking a live agent's figures as `memtop cleanup` asks."""

from __future__ import annotations

import argparse

from memtop.commands.actions import agent_action


def run(args: argparse.Namespace) -> int:
    from memtop import protocol
    from memtop.estimate import command

    source = getattr(args, "from_recording", None)
    pid = protocol.decimal(str(source)) if source is not None else None
    if source is not None and pid is not None and not source.exists():
        # `--from PID`: a live agent's figures, asked as `memtop cleanup` asks (same checks).
        sample = agent_action(pid, "sample", {}, None)
        breakdown = agent_action(pid, "breakdown", {"wait_s": 10.0}, None)
        args.live_replies = (pid, sample, None if breakdown.get("pending") else breakdown)
    return command.run(args)  # its errors are MemtopErrors (a usage error's exit code is 2)
