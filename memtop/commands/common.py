"""What several commands share: the sampler as the command line builds it, the scope its flags
ask for (--only, --user, --pid), and whether a person is at a terminal."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # loaded when a command runs, not when the parser is built
    from memtop.sampler import Sampler
    from memtop.scope import Scope

# Textual draws on stderr (its driver writes to sys.__stderr__); the first paint goes there too.
TERMINAL_FD = 2


def make_sampler(args: argparse.Namespace, simulated_only: bool = False) -> Sampler:
    from memtop.sampler import Sampler
    from memtop.sources.agents import AgentPool
    from memtop.sources.devices import DefaultDeviceSource
    from memtop.store import Store

    store = Store()
    devices = DefaultDeviceSource(args.socket_dir, simulated_only=simulated_only)
    return Sampler(store, devices, AgentPool(args.socket_dir), interval=args.interval)


def scope(args: argparse.Namespace) -> Scope:
    from memtop.scope import Scope

    return Scope(
        gpus=getattr(args, "only", None),
        users=getattr(args, "user", None),
        pids=getattr(args, "pid", None),
    )


def on_a_terminal() -> bool:
    return sys.stdout.isatty() and sys.stdin.isatty()
