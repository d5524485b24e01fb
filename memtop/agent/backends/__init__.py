"""The trainer-side device backends: one module per accelerator, chosen by the registry below.

A backend is the accelerator's part of the agent's probe (`memtop.agent.probe.DeviceBackend`):
its devices, its allocator's counters, snapshot, cache, settings, stack recording and OOM
observer.  `memtop.agent.torch_probe.TorchProbe` adds torch's side that no accelerator changes
(the optimizer step hooks, the breakdown walk, autograd's pass).  The agent's server and handlers
never import a backend (a contract in pyproject.toml); they see the probe.

A backend module has:
- `NAME`: a short word ("cuda");
- `detect() -> DeviceBackend | None`: the backend when this process's torch has that
  accelerator, else None.  Asked once, when the program has imported torch (the lazy probe), on
  whichever thread builds the probe: cheap, and it must initialise no device runtime;
- a class implementing `DeviceBackend`, and of `BackendExtras` what it can (each method with
  the thread rule its interface marks: `any_thread` / `trainer_thread`).

Adding an accelerator (torch.accelerator's generic memory API, XPU, MPS) is one module here and
its line in BACKENDS, above the CUDA one.
"""

from __future__ import annotations

import importlib
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memtop.agent.probe import DeviceBackend

# Asked in order; the first whose detect() gives a backend is the one.  torch.cuda exists in
# every build of torch (a CPU build reports no device through it): CUDA/ROCm comes last, the
# default.
BACKENDS: list[str] = [
    "memtop.agent.backends.cuda",  # CUDA and ROCm (torch.cuda is HIP on ROCm builds)
]

_lock = threading.Lock()
# Why a backend was passed over (its import or detect() raised): for whoever wonders.
skipped: dict[str, str] = {}


def register(module: str) -> None:
    """Ask `module` (a backend module's import name) first from now on: the program's own
    backend, or a test's.  Idempotent; a probe built before keeps the backend it chose."""
    with _lock:
        if module in BACKENDS:
            BACKENDS.remove(module)
        BACKENDS.insert(0, module)


def unregister(module: str) -> None:
    with _lock:
        if module in BACKENDS:
            BACKENDS.remove(module)


def select() -> DeviceBackend:
    """The first backend of BACKENDS that detects its accelerator in this process."""
    with _lock:
        names = list(BACKENDS)
    for name in names:
        try:
            backend = importlib.import_module(name).detect()
        except Exception as exc:  # a backend that cannot load must not cost the others
            skipped[name] = repr(exc)
            continue
        if backend is not None:
            return backend
    raise RuntimeError(f"no device backend detected (asked: {', '.join(names) or 'none'})")
