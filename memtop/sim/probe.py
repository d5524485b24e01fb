"""The simulated probe: the Probe interface over simulated caching allocators (no torch)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memtop.agent.probe import Breakdown, ProbeDevice, StepCallback
from memtop.sim.allocator import SimulatedCachingAllocator


@dataclass
class SimulatedGpu:
    device: ProbeDevice
    allocator: SimulatedCachingAllocator


class SimulatedProbe:
    def __init__(
        self,
        gpus: list[SimulatedGpu],
        allocator_conf: str = "",
        breakdown: Callable[[], dict[int, Breakdown]] | None = None,
        current_pass: Callable[[], str] | None = None,
        hip: str | None = None,
    ) -> None:
        """`hip`: the HIP version a ROCm build of torch would report (a trainer "on AMD")."""
        self._gpus = {gpu.device.index: gpu for gpu in gpus}
        self._hip = hip
        self._env_conf = allocator_conf  # the environment's, as the trainer started
        self._conf = allocator_conf  # in force: `memtop tune` changes it
        self._breakdown = breakdown
        self._current_pass = current_pass

    def _allocator(self, index: int) -> SimulatedCachingAllocator:
        try:
            return self._gpus[index].allocator
        except KeyError:
            raise ValueError(f"no simulated device {index} in this process") from None

    def torch_version(self) -> str | None:
        return None

    def hip_version(self) -> str | None:
        return self._hip

    def allocator_conf(self) -> str:
        return self._env_conf

    def allocator_settings(self) -> str | None:
        """As torch's `_accelerator_getAllocatorSettings`: the option string in force."""
        return self._conf

    def set_allocator_settings(self, text: str) -> None:
        """As torch's `_accelerator_setAllocatorSettings`: the whole string, every allocator at
        once; new segments follow it, cached ones keep their kind.  A string the simulated
        allocator refuses (as torch would) changes nothing."""
        for gpu in self._gpus.values():
            gpu.allocator.check_settings(text)
        for gpu in self._gpus.values():
            gpu.allocator.set_settings(text)
        self._conf = text

    def devices(self) -> list[ProbeDevice]:
        return [gpu.device for gpu in self._gpus.values()]

    def memory_stats(self, index: int) -> dict[str, int]:
        return self._allocator(index).memory_stats()

    def is_capturing(self) -> bool:
        return False  # the simulator has no CUDA graphs

    def memory_allocated(self, index: int) -> int:
        return self._allocator(index).memory_allocated()

    def mark_reading(self, index: int) -> tuple[int, int, int]:
        return self._allocator(index).allocated_counts()

    def mem_get_info(self, index: int) -> tuple[int, int]:
        return self._allocator(index).mem_get_info()

    def empty_cache(self, index: int) -> None:
        self._allocator(index).empty_cache()

    def reset_peak(self, index: int) -> None:
        self._allocator(index).reset_peak_memory_stats()

    def snapshot(self) -> dict[str, Any]:
        segments: list[dict[str, Any]] = []
        for gpu in self._gpus.values():
            segments.extend(gpu.allocator.memory_snapshot())
        return {
            "segments": segments,
            "device_traces": [[] for _ in self._gpus],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": self._conf},
        }

    def breakdown(self) -> dict[int, Breakdown]:
        return self._breakdown() if self._breakdown is not None else {}

    def attach_oom_observer(self, observer: Callable[[int, int, int, int], None]) -> bool:
        """As torch's: called on the allocating thread at every out-of-memory."""
        for gpu in self._gpus.values():
            gpu.allocator.attach_out_of_memory_observer(observer)
        return True

    def record_history(self, enabled: bool) -> bool:
        """torch.cuda.memory._record_memory_history(enabled="state"/None, stacks="python")."""
        for gpu in self._gpus.values():
            gpu.allocator.record_history(enabled)
        return True

    def current_pass(self) -> str | None:
        """Any thread: forward / backward / optimizer, as the simulated workload says."""
        return self._current_pass() if self._current_pass is not None else None

    def install_step_hook(self, on_step: StepCallback) -> bool:
        # The simulated trainer calls memtop.step() itself.
        return False

    def remove_step_hook(self) -> None:
        pass
