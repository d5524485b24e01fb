"""Which device view the memtop process reads: the GPU drivers present (NVIDIA's NVML, AMD's
amdsmi, both on a mixed box), else the simulated GPUs of a running demo."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from memtop.model import DriverReading
from memtop.sim.devices_view import SimulatedDeviceSource
from memtop.sources.amdsmi import AmdSmiSource
from memtop.sources.nvml import NvmlSource


class DefaultDeviceSource:
    """Every driver that answers; otherwise a demo's simulated GPUs if one is running.

    NVML and amdsmi are both asked each round (a library that is not on the machine is looked
    for once).  With both answering, the reading holds both vendors' GPUs, AMD's numbered after
    NVIDIA's, and its `source` names both ("nvml+amdsmi").  With none, the error shown is
    NVML's, as before AMD support, unless AMD's library is present: then the box is an AMD one
    and amdsmi's line (no permission, driver not loaded, …) is the one that explains.
    """

    def __init__(self, socket_dir: Path | None = None, simulated_only: bool = False) -> None:
        self.nvml = None if simulated_only else NvmlSource()
        self.amd = None if simulated_only else AmdSmiSource()
        self.sim = SimulatedDeviceSource(socket_dir)

    def read(self) -> DriverReading:
        nvidia = self.nvml.read() if self.nvml is not None else None
        amd = self.amd.read() if self.amd is not None else None
        answering = [r for r in (nvidia, amd) if r is not None and r.available]
        if len(answering) == 2:
            assert nvidia is not None and amd is not None
            return _both(nvidia, amd)
        if answering:
            return answering[0]
        simulated = self.sim.read()
        if simulated.available:
            return simulated
        if amd is not None and self.amd is not None and self.amd.library_found:
            return amd
        return nvidia or simulated

    def close(self) -> None:
        for source in (self.nvml, self.amd):
            if source is not None:
                source.close()


def _both(nvidia: DriverReading, amd: DriverReading) -> DriverReading:
    """One reading of a box with NVIDIA and AMD GPUs: AMD's numbered after NVIDIA's, so that a
    GPU number (`--only`, the table's GPU column) names one GPU."""
    offset = 1 + max((d.index for d in nvidia.devices), default=-1)
    renumbered = tuple(replace(d, index=d.index + offset) for d in amd.devices)
    versions = [v for v in (nvidia.driver_version, amd.driver_version) if v]
    return DriverReading(
        available=True,
        devices=nvidia.devices + renumbered,
        driver_version=" / ".join(versions) or None,
        source=f"{nvidia.source}+{amd.source}",
    )
