"""Which device view the memtop process reads: NVML, else the simulated GPUs of a running demo."""

from __future__ import annotations

from pathlib import Path

from memtop.model import NvmlReading
from memtop.sim.devices_view import SimulatedDeviceSource
from memtop.sources.nvml import NvmlSource


class DefaultDeviceSource:
    """NVML when the driver answers; otherwise a demo's simulated GPUs if one is running.

    The NVML error is kept in the reading so the UI can still say why the driver is missing.
    """

    def __init__(self, socket_dir: Path | None = None, simulated_only: bool = False) -> None:
        self.nvml = None if simulated_only else NvmlSource()
        self.sim = SimulatedDeviceSource(socket_dir)

    def read(self) -> NvmlReading:
        reading = self.nvml.read() if self.nvml is not None else None
        if reading is not None and reading.available:
            return reading
        simulated = self.sim.read()
        if simulated.available:
            return simulated
        return reading or simulated

    def close(self) -> None:
        if self.nvml is not None:
            self.nvml.close()
