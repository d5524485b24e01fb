"""The simulated GPUs of running demos, read the way NVML would report them."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from memtop.model import SOURCE_SIM, DeviceReading, DriverReading, GpuProcess

if TYPE_CHECKING:
    from memtop.sim.device import LedgerReader, SimGpuSpec


class SimulatedDeviceSource:
    """Devices and per-process usage from demo registries (the demo's stand-in for NVML): a
    memtop.sources.device_source.DeviceSource."""

    def __init__(self, socket_dir: Path | None = None) -> None:
        self.socket_dir = socket_dir
        # Each registry's GPU list with each GPU's ledger path, made again only when its file
        # changes (a stat a second instead of a read and a JSON parse: the list is written once,
        # when a demo starts).
        self._specs: dict[Path, tuple[tuple[int, int], list[tuple[SimGpuSpec, str]]]] = {}
        self._ledgers: LedgerReader | None = None

    @property
    def source(self) -> str:
        return SOURCE_SIM

    def _gpus(self, root: Path) -> list[tuple[SimGpuSpec, str]]:
        """The GPUs of the registry at `root`, each with its ledger's path."""
        from memtop.sim.device import SimGpuRegistry

        registry = SimGpuRegistry(root)
        try:
            info = os.stat(registry.gpus_path)
        except OSError:
            return []
        version = (info.st_mtime_ns, info.st_size)
        known = self._specs.get(root)
        if known is None or known[0] != version:
            gpus = [(spec, str(registry.ledger_path(spec.index))) for spec in registry.gpus()]
            known = self._specs[root] = (version, gpus)
        return known[1]

    def read(self) -> DriverReading:
        # The simulator is imported here, the first time no driver answers (a demo's GPUs are
        # looked for): a box whose driver answers never loads it.
        from memtop.sim.demo import live_registries
        from memtop.sim.device import LedgerReader

        if self._ledgers is None:
            self._ledgers = LedgerReader()
        roots = live_registries(self.socket_dir)
        self._specs = {root: known for root, known in self._specs.items() if root in roots}
        gpus = [gpu for root in roots for gpu in self._gpus(root)]
        # Every GPU's ledger in one go: each process's liveness asked once, whatever it uses.
        usages = self._ledgers.usage([ledger for _, ledger in gpus])
        devices = []
        for (spec, _), usage in zip(gpus, usages, strict=True):
            used = sum(n for _, n in usage)
            util, temperature, power = _plausible_load(spec.index, len(usage))
            devices.append(
                DeviceReading(
                    index=spec.index,
                    uuid=spec.uuid,
                    name=spec.name,
                    total_bytes=spec.total_bytes,
                    used_bytes=used,
                    free_bytes=max(0, spec.total_bytes - used),
                    processes=tuple(GpuProcess(pid, n) for pid, n in usage),
                    source=SOURCE_SIM,
                    utilization_percent=util,
                    temperature_c=temperature,
                    power_watts=power,
                    pci_bus_id=spec.pci_bus_id,
                    vendor=spec.vendor if spec.vendor != "nvidia" else None,
                )
            )
        if not devices:
            return DriverReading(available=False, error="no simulated GPUs", source=SOURCE_SIM)
        return DriverReading(available=True, devices=tuple(devices), source=SOURCE_SIM)

    def close(self) -> None:
        pass


def _plausible_load(index: int, processes: int) -> tuple[int, int, float]:
    """Utilisation, temperature and power an H100 shows under this many trainers: busy GPUs
    at 80-99 %, 45-75 °C, up to ~700 W; idle ones at 0 %, ~32 °C, ~70 W.  They drift slowly
    (a new value every 5 s), as a real board's do between kernels."""
    if processes == 0:
        return 0, 32 + index % 3, 70.0
    phase = int(time.time() // 5) / 3 + index
    util = min(99, 80 + 5 * min(processes, 3) - 3 + round(4 * math.sin(phase)))
    temperature = 45 + util * 3 // 10 + index % 4
    return util, temperature, round(90 + util * 6.1 + 10 * math.cos(phase), 0)
