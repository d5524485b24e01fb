"""Callbacks for training frameworks: `memtop.integrations.hf.MemtopCallback` (transformers'
Trainer) and `memtop.integrations.lightning.MemtopCallback` (Lightning's Trainer).

Each starts the agent, makes memtop's step number follow the framework's `global_step` (one step
per optimizer update, gradient accumulation included) and says the phase (train / eval / save)
so that OOM reports name it.  Importing this package imports neither framework; importing one
of its modules imports that framework only.

May import: `memtop.agent` (start_agent, step) and the standard library; nothing of the viewer (a
contract). Imported by nothing of memtop: a trainer imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import memtop


def start(socket_dir: str | Path | None, quiet: bool) -> Any:
    """Start (or find) the agent; never raises into the trainer."""
    try:
        return memtop.start_agent(socket_dir=socket_dir, quiet=quiet)
    except Exception:
        return None
