"""What several commands share: the sampler as the command line builds it, the scope its flags
ask for (--only, --user, --pid), the `--on-alert` runner, and whether a person is at a terminal."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # loaded when a command runs, not when the parser is built
    from memtop.engine.observation import Observer
    from memtop.engine.sampler import Sampler
    from memtop.engine.scope import Scope
    from memtop.present.alerts import AlertRunner

# Textual draws on stderr (its driver writes to sys.__stderr__); the first paint goes there too.
TERMINAL_FD = 2


def make_sampler(args: argparse.Namespace, simulated_only: bool = False) -> Sampler:
    from memtop.engine.sampler import Sampler
    from memtop.engine.store import Store
    from memtop.sources.agents import AgentPool
    from memtop.sources.devices import DefaultDeviceSource

    store = Store()
    devices = DefaultDeviceSource(args.socket_dir, simulated_only=simulated_only)
    return Sampler(store, devices, AgentPool(args.socket_dir), interval=args.interval)


def alerts(
    args: argparse.Namespace, observer: Observer, log: Callable[[str], None]
) -> AlertRunner | None:
    """`--on-alert CMD`: a runner told of every observation `observer` builds (None without)."""
    command = getattr(args, "on_alert", None)
    if not command:
        return None
    from memtop.model import Severity
    from memtop.present.alerts import AlertRunner

    runner = AlertRunner(command, Severity(args.alert_severity), log=log, scope=scope(args).apply)
    observer.listeners.append(runner.observe)
    return runner


def scope(args: argparse.Namespace) -> Scope:
    from memtop.engine.scope import Scope

    only = getattr(args, "only", None) or ()
    # `--only 0,1:2`: whole GPUs by number, MIG instances as (GPU, GPU instance id).
    gpus = frozenset(c for c in only if isinstance(c, int))
    instances = frozenset(c for c in only if isinstance(c, tuple))
    return Scope(
        gpus=gpus or None,
        instances=instances or None,
        users=getattr(args, "user", None),
        pids=getattr(args, "pid", None),
    )


def on_a_terminal() -> bool:
    return sys.stdout.isatty() and sys.stdin.isatty()
