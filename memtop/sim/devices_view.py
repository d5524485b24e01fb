"""The simulated GPUs of running demos, read the way NVML would report them."""

from __future__ import annotations

from pathlib import Path

from memtop.model import SOURCE_SIM, DeviceReading, GpuProcess, NvmlReading
from memtop.sim.demo import live_registries
from memtop.sim.device import SimGpuRegistry


class SimulatedDeviceSource:
    """Devices and per-process usage from demo registries (the demo's stand-in for NVML)."""

    def __init__(self, socket_dir: Path | None = None) -> None:
        self.socket_dir = socket_dir

    def read(self) -> NvmlReading:
        devices = []
        for root in live_registries(self.socket_dir):
            registry = SimGpuRegistry(root)
            for spec in registry.gpus():
                usage = registry.usage_by_pid(spec.index)
                used = sum(usage.values())
                devices.append(
                    DeviceReading(
                        index=spec.index,
                        uuid=spec.uuid,
                        name=spec.name,
                        total_bytes=spec.total_bytes,
                        used_bytes=used,
                        free_bytes=max(0, spec.total_bytes - used),
                        processes=tuple(GpuProcess(pid, n) for pid, n in sorted(usage.items())),
                        source=SOURCE_SIM,
                    )
                )
        if not devices:
            return NvmlReading(available=False, error="no simulated GPUs", source=SOURCE_SIM)
        return NvmlReading(available=True, devices=tuple(devices), source=SOURCE_SIM)

    def close(self) -> None:
        pass
