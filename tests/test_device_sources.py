"""The device-source protocol (issue 22.4): NVML, amdsmi and the simulator are implementations of
one protocol, the shared base holds the retry, lost-device and back-off logic, and the combined
source reads any list of drivers.  A new vendor is one module and its line in DRIVERS: here a
made-up one, written in this file alone, gets all of that behaviour."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fake_nvml import FakeClock, FakeNvml
from test_amd import Fixed

from memtop.model import SOURCE_AMDSMI, SOURCE_NVML, SOURCE_SIM, DeviceReading, DriverReading
from memtop.sim.devices_view import SimulatedDeviceSource
from memtop.sources.amdsmi import AmdSmiSource
from memtop.sources.device_source import (
    DeviceSource,
    DriverDevice,
    DriverLibrarySource,
    DriverSource,
    joined_errors,
)
from memtop.sources.devices import CombinedDeviceSource, DefaultDeviceSource
from memtop.sources.nvml import NvmlSource

LOST, DOWN = 1, 2


class VendorError(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"code {code}")
        self.code = code


class VendorLib:
    """A made-up vendor's library: two GPUs; a GPU or the whole library can be made to fail."""

    def __init__(self) -> None:
        self.inits = 0
        self.failing: dict[int, int] = {}  # GPU index → the code its queries raise
        self.down = False

    def init(self) -> None:
        if self.down:
            raise VendorError(DOWN)
        self.inits += 1

    def shutdown(self) -> None:
        pass

    def count(self) -> int:
        if self.down:
            raise VendorError(DOWN)
        return 2

    def used(self, index: int) -> int:
        if index in self.failing:
            raise VendorError(self.failing[index])
        return 100 + index


class VendorSource(DriverLibrarySource[DriverDevice]):
    """All a new vendor writes: its library's calls and its words."""

    NAME = "vendor"
    SHUTDOWN = "shutdown"
    LOST_CODES = frozenset({LOST})
    DOWN_CODES = frozenset({DOWN})

    def __init__(self, lib: VendorLib, clock: FakeClock) -> None:
        super().__init__(lib, "vendor", clock, retry_interval=10.0)

    @property
    def library_found(self) -> bool:
        return True

    def error_line(self, exc: BaseException) -> str:
        return f"vendor: {exc}"

    def _error_code(self, exc: BaseException) -> int | None:
        return exc.code if isinstance(exc, VendorError) else None

    def _initialise(self) -> None:
        self._lib.init()
        self._initialised = True

    def _devices_to_read(self) -> list[DriverDevice]:
        try:
            count = self._lib.count()
        except Exception as exc:
            self._check_fatal(exc)  # the library gone down: DriverDown
            raise
        if len(self._devices) != count:
            self._devices = [DriverDevice(i) for i in range(count)]
        return self._devices

    def _reopen(self, device: DriverDevice, now: float) -> bool:
        device.handle, device.down_error = device.index, None
        return True

    def _query_device(self, device: DriverDevice, errors: list[str]) -> DeviceReading:
        try:
            used: int | None = self._lib.used(device.index)
        except Exception as exc:
            self._check_fatal(exc)
            errors.append(self.error_line(exc))
            used = None
        return DeviceReading(
            device.index, f"V-{device.index}", "V", 1000, used, error=joined_errors(errors)
        )

    def _failed_device(self, device: DriverDevice, error: str) -> DeviceReading:
        return DeviceReading(device.index, f"V-{device.index}", "V", None, None, error=error)


def test_a_new_vendor_gets_the_shared_retry_and_lost_device_logic():
    lib, clock = VendorLib(), FakeClock()
    source = VendorSource(lib, clock)
    assert [d.used_bytes for d in source.read().devices] == [100, 101]
    # One GPU lost: the other still read; the lost one not asked again before the interval.
    lib.failing[1] = LOST
    assert [d.error for d in source.read().devices] == [None, "vendor: code 1"]
    del lib.failing[1]
    clock.advance(5)
    assert source.read().devices[1].error == "vendor: code 1"
    clock.advance(6)
    assert source.read().devices[1].used_bytes == 101
    # The library down: unavailable, and initialised again only at the retry pace.
    lib.down = True
    assert source.read().error == "vendor: code 2"
    lib.down = False
    assert source.read().error == "vendor: code 2"
    clock.advance(11)
    assert source.read().available and lib.inits == 2


def _gpus(source: str, n: int) -> DriverReading:
    return DriverReading(
        True,
        tuple(DeviceReading(i, f"{source}-{i}", "G", 1, 0, source=source) for i in range(n)),
        source=source,
    )


def test_any_list_of_drivers_is_read_as_one_box():
    combined = CombinedDeviceSource(
        [Fixed(_gpus("nvml", 2)), Fixed(_gpus("amdsmi", 1)), Fixed(_gpus("vendor", 2))],
        SimulatedDeviceSource(Path("/nonexistent-socket-dir")),
    )
    reading = combined.read()
    assert reading.source == "nvml+amdsmi+vendor"
    assert [(d.index, d.uuid) for d in reading.devices] == [
        (0, "nvml-0"),
        (1, "nvml-1"),
        (2, "amdsmi-0"),
        (3, "vendor-0"),
        (4, "vendor-1"),
    ]


def test_every_source_is_a_device_source(tmp_path: Path):
    sources: list[Any] = [NvmlSource(FakeNvml([])), AmdSmiSource(), SimulatedDeviceSource(tmp_path)]
    assert [s.source for s in sources] == [SOURCE_NVML, SOURCE_AMDSMI, SOURCE_SIM]
    for source in sources:
        assert isinstance(source, DeviceSource)
    assert all(isinstance(s, DriverSource) for s in sources[:2])
    live = DefaultDeviceSource(tmp_path)
    assert [type(d) for d in live.drivers] == [NvmlSource, AmdSmiSource]
    assert DefaultDeviceSource(tmp_path, simulated_only=True).drivers == ()
