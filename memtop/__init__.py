"""memtop: a terminal dashboard for GPU memory in PyTorch work.

In a trainer, `import memtop; memtop.start_agent()` lets a `memtop` viewer attach; `memtop.step()`
marks step boundaries in loops without a torch optimizer.  Importing memtop is cheap and does not
import torch.
"""

from memtop._version import __version__
from memtop.agent import phase, start_agent, step, sync_step

__all__ = ["__version__", "phase", "start_agent", "step", "sync_step"]
