"""The in-trainer side of memtop: `start_agent()` and `step()`.

Importing this package does not import torch; the torch probe is imported only when an agent
starts without an explicit probe.

May import: `memtop.protocol` (its standard-library parts: framing, replies), `memtop.figures`,
`memtop.base`, `memtop.model`'s records only where a contract allows; never the viewer
(`memtop.engine`, `memtop.ui`, `memtop.sources`, …: a contract). Only `agent.torch_probe` and
`agent.backends.cuda` import torch, and the serving modules (server, handlers, boundary, …) import
neither torch nor a backend.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memtop.agent.probe import Probe
    from memtop.agent.server import Agent

_lock = threading.Lock()
_agent: Agent | None = None


def start_agent(
    probe: Probe | None = None,
    socket_dir: str | Path | None = None,
    quiet: bool = True,
    argv: list[str] | None = None,
) -> Agent | None:
    """Start the agent thread once per process; later calls return the running agent.

    Never raises: if the agent cannot start (unsafe socket directory, no torch), it says why on
    stderr once and the trainer goes on without it.
    """
    global _agent
    with _lock:
        if _agent is not None:
            return _agent
        try:
            if probe is None:
                # torch is loaded when the program loads it, not before (`memtop run`, attach).
                from memtop.agent.lazy_probe import LazyTorchProbe

                probe = LazyTorchProbe()
            from memtop.agent.server import Agent

            agent = Agent(probe, Path(socket_dir) if socket_dir else None, argv=argv)
            path = agent.start()
        except Exception as exc:
            print(f"memtop: agent not started: {exc}", file=sys.stderr)
            return None
        try:
            probe.install_step_hook(agent.on_step)
        except Exception as exc:
            # The agent still serves memory; only automatic step counting is lost.
            print(
                f"memtop: steps not counted automatically ({exc}); call memtop.step()",
                file=sys.stderr,
            )
        _agent = agent
        atexit.register(_stop_at_exit)
        from memtop.agent import auto_cleanup

        if auto_cleanup.wanted(os.environ):
            agent.boundary.on_boundary = auto_cleanup.AutoCleanup(agent)
        if not quiet:
            print(f"memtop: agent listening on {path}", file=sys.stderr)
        return agent


def step() -> None:
    """Mark the end of a training step, for loops that do not use a torch optimizer."""
    agent = _agent
    if agent is not None:
        agent.on_step(explicit=True)


def sync_step(global_step: int) -> None:
    """Say the framework's own count of optimizer updates (HF's / Lightning's `global_step`),
    for the step number memtop reports; see StepBoundary.sync_step.  Cheap; never raises."""
    agent = _agent
    if agent is not None:
        agent.boundary.sync_step(global_step)


def phase(name: str) -> None:
    """Say what the trainer does now: "train", "eval", "save"...  OOM reports name the phase
    and viewers can tell eval from training.  Cheap (an attribute write); never raises."""
    agent = _agent
    if agent is not None:
        agent.boundary.set_phase(name)


def current_agent() -> Agent | None:
    return _agent


def stop_agent() -> None:
    global _agent
    with _lock:
        agent, _agent = _agent, None
    if agent is not None:
        agent.stop()


def _stop_at_exit() -> None:
    agent = _agent
    if agent is not None and agent.pid == os.getpid():
        agent.stop(timeout=0.5)


def _forget_in_child() -> None:
    # A forked child (a DataLoader worker, say) has no agent thread; it must not claim the
    # parent's socket, and may start its own agent.
    global _agent
    _agent = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
