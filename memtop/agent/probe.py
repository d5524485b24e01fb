"""The interface between the agent and an allocator: torch.cuda on a GPU, or the simulator.

The agent thread only talks to a Probe.  `memtop.agent.torch_probe.TorchProbe` is the only code
in memtop that imports torch; `memtop.sim.probe.SimulatedProbe` drives the simulated caching
allocator for `memtop demo` and the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from memtop.protocol import replies


@dataclass(frozen=True, slots=True)
class ProbeDevice:
    index: int
    uuid: str
    name: str
    total_bytes: int
    # protocol.canonical_pci_bus_id form, where torch gives the numbers: on ROCm the viewer joins
    # the device with amdsmi's by it (torch's UUID there is HIP's, not the driver's).
    pci_bus_id: str | None = None


# The variables torch's caching allocator reads its options from.  PYTORCH_HIP_ALLOC_CONF is
# the ROCm spelling: torch's ROCm builds read it when the others are unset (c10/core/
# AllocatorConfig.cpp, AcceleratorAllocatorConfig::instance; before 2.9 c10/cuda/
# CUDAAllocatorConfig.h under USE_ROCM).
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def allocator_conf_from_env(env: Mapping[str, str]) -> str:
    """The allocator options of a process with environment `env` (the first variable set)."""
    return next((env[name] for name in ALLOC_CONF_VARIABLES if env.get(name)), "")


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

# The documented subset of torch.cuda.memory_stats() keys that `sample` carries (DESIGN §6):
# every key memtop's viewer, its JSON report and its exporters read, and a few that explain them.
# Building only these is what keeps a `sample` cheap on the trainer's GIL.
# The subset of torch.cuda.memory_stats() keys a `sample` carries: every key memtop or its JSON
# report reads.  Part of the wire schema, so its home is the protocol.
SAMPLE_STAT_KEYS = replies.SAMPLE_STAT_KEYS


class Probe(Protocol):
    """What the agent needs from an allocator.

    Two kinds of method (DESIGN §6, "thread discipline"):
    - *any thread*: host-side reads that touch no tensor and make no CUDA call that could
      synchronise or disturb a graph capture (versions, the allocator's own counters, the
      devices the trainer already uses).  The agent thread calls these while the trainer runs.
    - *trainer's thread only*: everything else (`mem_get_info`, `empty_cache`, `snapshot`,
      `breakdown`, `is_capturing`).  The agent runs them from the step boundary.
    None may create a CUDA context on a device the trainer has not used.

    Optional, asked with getattr (a probe without it is taken to run on CUDA):
    `hip_version() -> str | None`, any thread: torch.version.hip, set on a ROCm build.

    Optional, asked with getattr (a probe without them cannot change the allocator's settings,
    and `memtop tune` is refused in one line):
    `allocator_settings() -> str | None`, any thread: the allocator's option string in force
    (None: unknown); `set_allocator_settings(text: str) -> None`, trainer's thread at a step
    boundary: replace the whole string (torch resets every key it leaves out); raises
    NotImplementedError where this torch cannot.
    """

    def torch_version(self) -> str | None:
        """Any thread."""
        ...

    def allocator_conf(self) -> str:
        """Any thread."""
        ...

    def devices(self) -> list[ProbeDevice]:
        """Any thread.  Devices the trainer has used so far (possibly none yet)."""
        ...

    def memory_stats(self, index: int) -> dict[str, int]:
        """Any thread: the allocator's host-side counters, at least SAMPLE_STAT_KEYS."""
        ...

    def memory_allocated(self, index: int) -> int:
        """Any thread.  Cheap: read behind step marks by the step hook."""
        ...

    def reset_peak(self, index: int) -> None:
        """Any thread: resets a host-side counter."""
        ...

    def is_capturing(self) -> bool:
        """Trainer's thread: whether a CUDA graph is being captured on its current stream."""
        ...

    def mem_get_info(self, index: int) -> tuple[int, int]:
        """Trainer's thread.  (free, total) bytes of the device as the driver sees it."""
        ...

    def empty_cache(self, index: int) -> None:
        """Trainer's thread."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """Trainer's thread.  torch.cuda.memory._snapshot()'s format: {"segments": [...],
        "device_traces": [...]}."""
        ...

    def breakdown(self) -> dict[int, Breakdown]:
        """Trainer's thread, right after an optimizer step (gradients alive)."""
        ...

    def install_step_hook(self, on_step: StepCallback) -> bool:
        """Arrange for `on_step` after every optimizer step; False when there is no such hook."""
        ...

    def remove_step_hook(self) -> None:
        """Undo install_step_hook (torch's hook is process-global)."""
        ...
