"""The interface between the agent and an allocator: torch.cuda on a GPU, or the simulator.

The agent thread only talks to a Probe.  `memtop.agent.torch_probe.TorchProbe` is the only code
in memtop that imports torch; `memtop.sim.probe.SimulatedProbe` drives the simulated caching
allocator for `memtop demo` and the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class ProbeDevice:
    index: int
    uuid: str
    name: str
    total_bytes: int


@dataclass(frozen=True, slots=True)
class Breakdown:
    """Bytes of one device by role; `other` (activations, temporaries) is the remainder."""

    parameters: int
    gradients: int
    optimizer_state: int
    allocated: int
    # How many parameters are stored in fp32 (a bf16 saving is half of their bytes).
    fp32_parameter_bytes: int = 0

    @property
    def other(self) -> int:
        return max(0, self.allocated - self.parameters - self.gradients - self.optimizer_state)

    def as_dict(self) -> dict[str, int]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer_state": self.optimizer_state,
            "other": self.other,
            "allocated": self.allocated,
            "fp32_parameter_bytes": self.fp32_parameter_bytes,
        }


StepCallback = Callable[[], None]


class Probe(Protocol):
    """What the agent needs from an allocator.  Every method may be called from the agent thread
    while the trainer runs; none may create a CUDA context on a device the trainer has not used.
    """

    def torch_version(self) -> str | None: ...

    def allocator_conf(self) -> str: ...

    def devices(self) -> list[ProbeDevice]:
        """Devices the trainer has used so far (possibly none yet)."""
        ...

    def memory_stats(self, index: int) -> dict[str, int]: ...

    def memory_allocated(self, index: int) -> int:
        """Cheap: called on every training step by the step hook."""
        ...

    def mem_get_info(self, index: int) -> tuple[int, int]:
        """(free, total) bytes of the device as the driver sees it."""
        ...

    def empty_cache(self, index: int) -> None: ...

    def reset_peak(self, index: int) -> None: ...

    def snapshot(self) -> dict[str, Any]:
        """torch.cuda.memory._snapshot()'s format: {"segments": [...], "device_traces": [...]}."""
        ...

    def breakdown(self) -> dict[int, Breakdown]: ...

    def install_step_hook(self, on_step: StepCallback) -> bool:
        """Arrange for `on_step` after every optimizer step; False when there is no such hook."""
        ...

    def remove_step_hook(self) -> None:
        """Undo install_step_hook (torch's hook is process-global)."""
        ...
