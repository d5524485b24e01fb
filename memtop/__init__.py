"""memtop: a terminal dashboard for GPU memory in PyTorch work.

In a trainer, `import memtop; memtop.start_agent()` lets a `memtop` viewer attach; `memtop.step()`
marks step boundaries in loops without a torch optimizer.  Importing memtop is cheap and does not
import torch.

The agent's names are looked up in memtop.agent when first used (PEP 562): the viewer, whose
modules all import this package first, never loads the agent.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from memtop._version import __version__

if TYPE_CHECKING:
    from memtop import agent as agent
    from memtop.agent import phase, start_agent, step, sync_step

__all__ = ["__version__", "phase", "start_agent", "step", "sync_step"]

_FROM_THE_AGENT = frozenset({"phase", "start_agent", "step", "sync_step"})


def __getattr__(name: str) -> Any:
    if name == "agent":
        return importlib.import_module("memtop.agent")
    if name in _FROM_THE_AGENT:
        return getattr(importlib.import_module("memtop.agent"), name)
    raise AttributeError(f"module 'memtop' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_FROM_THE_AGENT, "agent"})
