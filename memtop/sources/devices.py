"""Which device view the memtop process reads: the GPU drivers present (NVIDIA's NVML, AMD's
amdsmi, both on a mixed box), else the simulated GPUs of a running demo.

The device sources (memtop.sources.device_source.DeviceSource) are listed here, once: a new
vendor's source is its module plus its line in DRIVERS."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from memtop.model import DeviceReading, DriverReading
from memtop.sim.devices_view import SimulatedDeviceSource
from memtop.sources.amdsmi import AmdSmiSource
from memtop.sources.device_source import DeviceSource, DriverSource
from memtop.sources.nvml import NvmlSource

# The driver libraries, most common vendor first: their GPUs are numbered in this order.
DRIVERS: tuple[Callable[[], DriverSource], ...] = (NvmlSource, AmdSmiSource)


class CombinedDeviceSource:
    """Every driver that answers; otherwise the fallback (a demo's simulated GPUs) if it does.

    Every driver is asked each round (a library that is not on the machine is looked for once).
    With several answering, the reading holds every vendor's GPUs, each driver's numbered after
    the ones before it, and its `source` names them all ("nvml+amdsmi").  With none, the error
    shown is that of the last driver whose library is on the machine (the list runs from the
    most common vendor, whose library says least: NVIDIA's pynvml comes with memtop, while
    AMD's amdsmi is on a box only by choice), else the first driver's.
    """

    def __init__(self, drivers: Sequence[DriverSource], fallback: DeviceSource) -> None:
        self.drivers = tuple(drivers)
        self.fallback = fallback

    @property
    def source(self) -> str:
        return "+".join(driver.source for driver in self.drivers) or self.fallback.source

    def read(self) -> DriverReading:
        readings = [driver.read() for driver in self.drivers]
        answering = [r for r in readings if r.available]
        if len(answering) > 1:
            return _together(answering)
        if answering:
            return answering[0]
        simulated = self.fallback.read()
        if simulated.available or not readings:
            return simulated
        found = [r for d, r in zip(self.drivers, readings, strict=True) if d.library_found]
        return found[-1] if found else readings[0]

    def close(self) -> None:
        for source in (*self.drivers, self.fallback):
            source.close()


class DefaultDeviceSource(CombinedDeviceSource):
    """The drivers of DRIVERS with the simulated GPUs of `socket_dir`'s demos as the fallback;
    `simulated_only`: the simulated GPUs alone (`memtop demo`, tests)."""

    def __init__(self, socket_dir: Path | None = None, simulated_only: bool = False) -> None:
        drivers = () if simulated_only else tuple(make() for make in DRIVERS)
        super().__init__(drivers, SimulatedDeviceSource(socket_dir))


def _together(readings: Sequence[DriverReading]) -> DriverReading:
    """One reading of a box with several vendors' GPUs: each driver's numbered after the ones
    before it, so that a GPU number (`--only`, the table's GPU column) names one GPU."""
    devices: list[DeviceReading] = []
    for reading in readings:
        offset = 1 + max((d.index for d in devices), default=-1)
        devices += [replace(d, index=d.index + offset) for d in reading.devices]
    versions = [r.driver_version for r in readings if r.driver_version]
    return DriverReading(
        available=True,
        devices=tuple(devices),
        driver_version=" / ".join(versions) or None,
        source="+".join(r.source for r in readings),
    )
