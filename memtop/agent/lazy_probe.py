"""A torch probe that waits for the program to import torch itself.

`memtop run hello.py` and `memtop attach PID` start the agent before (or without) torch: importing
torch on the program's behalf costs ~1.5 s and prints torch's own warnings into a program that
may never use it.  Until torch is imported *and finished importing* this probe reports no torch
and no devices; from then on it hands every call to the real `TorchProbe`.

The step hook is installed as soon as torch is there: at once when it already is (an attach to a
running trainer), else by a small waiting thread that looks at `sys.modules` a few times a second.
Registering torch's global optimizer hook touches no tensor, so any thread may do it; a step
taken before the hook is in is simply not counted.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memtop.agent.probe import Breakdown, ProbeDevice, StepCallback, allocator_conf_from_env

if TYPE_CHECKING:
    from memtop.agent.torch_probe import TorchProbe

WAIT_POLL_S = 0.25


def torch_imported() -> bool:
    """True once the program's `import torch` has completed (not merely begun)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    spec = getattr(torch, "__spec__", None)
    if spec is not None and getattr(spec, "_initializing", False):
        return False
    # torch's __init__ imports these last among what the probe needs.
    return "torch.optim" in sys.modules and "torch.cuda" in sys.modules


def _attach_oom_observer(real: TorchProbe, observer: Callable[[int, int, int, int], None]) -> bool:
    attach = getattr(real, "attach_oom_observer", None)  # a backend without one has none
    return bool(attach(observer)) if attach is not None else False


class LazyTorchProbe:
    def __init__(self) -> None:
        self._real: TorchProbe | None = None
        self._lock = threading.Lock()
        self._on_step: StepCallback | None = None
        self._waiter: threading.Thread | None = None
        self._stopped = threading.Event()
        # An OOM observer asked for before torch was imported (`memtop run`: the agent starts
        # first): attached the moment the real probe exists, or OOM reports would never come.
        self._pending_oom_observer: Callable[[int, int, int, int], None] | None = None

    def real(self) -> TorchProbe | None:
        """The TorchProbe, once the program has imported torch; None before."""
        if self._real is not None:
            return self._real
        if not torch_imported():
            return None
        with self._lock:
            if self._real is None:
                from memtop.agent.torch_probe import TorchProbe

                self._real = TorchProbe()
                observer, self._pending_oom_observer = self._pending_oom_observer, None
                if observer is not None:
                    _attach_oom_observer(self._real, observer)
            return self._real

    def attach_oom_observer(self, observer: Callable[[int, int, int, int], None]) -> bool:
        """Any thread (the backend's attach only queues on torch's lazy CUDA init).  Before torch
        is imported: kept, and attached when the real probe is made (real())."""
        with self._lock:
            real = self._real
            if real is None and not torch_imported():
                self._pending_oom_observer = observer
                return True
        real = self.real()
        return real is not None and _attach_oom_observer(real, observer)

    def __getattr__(self, name: str) -> Any:
        # Whatever a newer Probe grows beyond these methods is the real probe's, once torch is
        # there; before, it does not exist (callers ask with getattr(probe, name, None)).
        if name.startswith("_"):
            raise AttributeError(name)
        real = self.real()
        if real is None:
            raise AttributeError(name)
        return getattr(real, name)

    # ------------------------------------------------------------ any thread
    def torch_version(self) -> str | None:
        real = self.real()
        return real.torch_version() if real else None

    def allocator_conf(self) -> str:
        real = self.real()
        if real:
            return real.allocator_conf()
        # The same variables TorchProbe reads; they need no torch.
        return allocator_conf_from_env(os.environ)

    def allocator_settings(self) -> str | None:
        real = self.real()
        read = getattr(real, "allocator_settings", None) if real else None
        return read() if read is not None else None

    def hip_version(self) -> str | None:
        real = self.real()
        hip = getattr(real, "hip_version", None) if real else None
        return hip() if hip is not None else None

    def devices(self) -> list[ProbeDevice]:
        real = self.real()
        return real.devices() if real else []

    def memory_stats(self, index: int) -> dict[str, int]:
        real = self.real()
        return real.memory_stats(index) if real else {}

    def memory_allocated(self, index: int) -> int:
        real = self.real()
        return real.memory_allocated(index) if real else 0

    def reset_peak(self, index: int) -> None:
        real = self.real()
        if real:
            real.reset_peak(index)

    # ------------------------------------------------------------ trainer's thread
    def is_capturing(self) -> bool:
        real = self.real()
        return real.is_capturing() if real else False

    def mem_get_info(self, index: int) -> tuple[int, int]:
        real = self.real()
        if real is None:
            raise RuntimeError("torch is not imported")
        return real.mem_get_info(index)

    def empty_cache(self, index: int) -> None:
        real = self.real()
        if real:
            real.empty_cache(index)

    def set_allocator_settings(self, text: str) -> None:
        real = self.real()
        if real is None:
            raise NotImplementedError("this program has not imported torch")
        setter = getattr(real, "set_allocator_settings", None)
        if setter is None:
            raise NotImplementedError("this device backend cannot change allocator settings")
        setter(text)

    def snapshot(self) -> dict[str, Any]:
        real = self.real()
        return real.snapshot() if real else {"segments": [], "device_traces": []}

    def breakdown(self) -> dict[int, Breakdown]:
        real = self.real()
        return real.breakdown() if real else {}

    # ------------------------------------------------------------ the step hook
    def install_step_hook(self, on_step: StepCallback) -> bool:
        self._on_step = on_step
        self._stopped.clear()
        real = self.real()
        if real is not None:
            return real.install_step_hook(on_step)
        if self._waiter is None or not self._waiter.is_alive():
            self._waiter = threading.Thread(
                target=self._wait_for_torch, name="memtop-torch-wait", daemon=True
            )
            self._waiter.start()
        return True

    def _wait_for_torch(self) -> None:
        while not self._stopped.wait(WAIT_POLL_S):
            if not torch_imported():
                continue
            try:
                real = self.real()
                if real is not None and self._on_step is not None and not self._stopped.is_set():
                    real.install_step_hook(self._on_step)
            except Exception as exc:  # never into the program
                print(f"memtop: steps not counted automatically ({exc})", file=sys.stderr)
            return

    def remove_step_hook(self) -> None:
        self._stopped.set()
        if self._real is not None:
            self._real.remove_step_hook()
