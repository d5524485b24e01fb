"""A programmable stand-in for the `pynvml` module (nvidia-ml-py), for tests without a GPU.

`FakeNvml` has the functions `memtop.sources.nvml.NvmlSource` calls, with pynvml's names and
signatures, and raises pynvml's own error classes (re-exported here, so `except
pynvml.NVMLError_GpuIsLost` and `except fake.NVMLError_GpuIsLost` are the same thing). Tests
describe devices with `FakeDevice`, inject failures with `fail()` and count calls with `count()`:

    fake = FakeNvml([FakeDevice(name="A100", total=80 * GiB, used=GiB)])
    fake.fail("nvmlDeviceGetMemoryInfo", index=0, error=fake.NVMLError_GpuIsLost)
    assert fake.count("nvmlDeviceGetHandleByIndex", index=0) == 1
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

GiB = 1 << 30
MiB = 1 << 20

# The raw NVML_VALUE_NOT_AVAILABLE of unsigned long long fields, as old bindings pass it through.
VALUE_NOT_AVAILABLE = 2**64 - 1


@dataclass
class FakeDevice:
    name: str = "NVIDIA A100-SXM4-80GB"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    total: int = 80 * GiB
    used: int = 0  # excludes `reserved`, as in nvmlMemory_v2_t
    reserved: int = 512 * MiB
    # (pid, usedGpuMemory): usedGpuMemory may be None or VALUE_NOT_AVAILABLE.
    compute: list[tuple[int, int | None]] = field(default_factory=list)
    graphics: list[tuple[int, int | None]] = field(default_factory=list)
    # (gpu %, memory %); None: NotSupported.
    utilization: tuple[int, int] | None = (0, 0)
    temperature: int | None = 40  # None: NotSupported
    # Whether the driver has nvmlDeviceGetMemoryInfo_v2 for this device.
    memory_v2: bool = True
    # nvmlPciInfo_t.busId as NVML writes it; None: nvmlDeviceGetPciInfo is NotSupported.
    bus_id: str | None = "00000000:3B:00.0"

    @property
    def free(self) -> int:
        return self.total - self.reserved - self.used


@dataclass(frozen=True)
class FakeHandle:
    index: int


@dataclass
class _Failure:
    function: str
    index: int | None
    error: Any
    times: int | None


class FakeNvml:
    """A module-like object with pynvml's functions, error classes and constants."""

    NVMLError = pynvml.NVMLError
    NVMLError_Uninitialized = pynvml.NVMLError_Uninitialized
    NVMLError_InvalidArgument = pynvml.NVMLError_InvalidArgument
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_NoPermission = pynvml.NVMLError_NoPermission
    NVMLError_NotFound = pynvml.NVMLError_NotFound
    NVMLError_DriverNotLoaded = pynvml.NVMLError_DriverNotLoaded
    NVMLError_Timeout = pynvml.NVMLError_Timeout
    NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound
    NVMLError_FunctionNotFound = pynvml.NVMLError_FunctionNotFound
    NVMLError_GpuIsLost = pynvml.NVMLError_GpuIsLost
    NVMLError_ResetRequired = pynvml.NVMLError_ResetRequired
    NVMLError_LibRmVersionMismatch = pynvml.NVMLError_LibRmVersionMismatch
    NVMLError_ArgumentVersionMismatch = pynvml.NVMLError_ArgumentVersionMismatch
    NVMLError_Unknown = pynvml.NVMLError_Unknown
    NVMLLibraryMismatchError = pynvml.NVMLLibraryMismatchError

    nvmlMemory_v2 = pynvml.nvmlMemory_v2
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU

    def __init__(
        self,
        devices: list[FakeDevice] | None = None,
        *,
        driver_version: str = "550.54.15",
        strings_as_bytes: bool = False,
        binding_has_memory_v2: bool = True,
        driver_has_v3_processes: bool = True,
    ) -> None:
        self.devices: list[FakeDevice] = list(devices or [])
        self.driver_version = driver_version
        # Old bindings return bytes for names, UUIDs and versions.
        self.strings_as_bytes = strings_as_bytes
        # False: an old nvidia-ml-py whose nvmlDeviceGetMemoryInfo has no `version` argument.
        self.binding_has_memory_v2 = binding_has_memory_v2
        # False: a driver before 510 without the `_v3` process-list symbols, where nvidia-ml-py's
        # unversioned wrappers raise NVMLLibraryMismatchError.
        self.driver_has_v3_processes = driver_has_v3_processes
        self.initialised = 0  # nvmlInit refcount, as NVML keeps one
        self.calls: Counter[tuple[str, int | None]] = Counter()
        self._failures: list[_Failure] = []

    # -- programming the fake ------------------------------------------------------------------

    def fail(
        self,
        function: str,
        *,
        index: int | None = None,
        error: Any = pynvml.NVMLError_Unknown,
        times: int | None = None,
    ) -> None:
        """Make `function` raise `error` (a class or an instance) for device `index` (None: any
        device, or a call without a device), `times` times (None: until `clear()`)."""
        self._failures.append(_Failure(function, index, error, times))

    def clear(self, function: str | None = None) -> None:
        """Remove the injected failures of `function` (None: all)."""
        self._failures = [
            f for f in self._failures if function is not None and f.function != function
        ]

    def count(self, function: str, index: int | None = None) -> int:
        """How many times `function` was called (for device `index`; None: in all)."""
        if index is None:
            return sum(n for (name, _), n in self.calls.items() if name == function)
        return self.calls[(function, index)]

    # -- internals -----------------------------------------------------------------------------

    def _enter(
        self,
        function: str,
        index: int | None = None,
        *,
        needs_init: bool = True,
        aliases: tuple[str, ...] = (),
    ) -> None:
        """Count the call, raise an injected failure (of `function` or an alias), check init."""
        self.calls[(function, index)] += 1
        for failure in self._failures:
            if failure.function != function and failure.function not in aliases:
                continue
            if failure.index is not None and failure.index != index:
                continue
            if failure.times is not None:
                if failure.times <= 0:
                    continue
                failure.times -= 1
            error = failure.error
            raise error() if isinstance(error, type) else error
        if needs_init and self.initialised <= 0:
            raise pynvml.NVMLError_Uninitialized()

    def _device(self, function: str, handle: Any, aliases: tuple[str, ...] = ()) -> FakeDevice:
        if not isinstance(handle, FakeHandle):
            raise pynvml.NVMLError_InvalidArgument()
        self._enter(function, handle.index, aliases=aliases)
        if handle.index >= len(self.devices):
            raise pynvml.NVMLError_GpuIsLost()
        return self.devices[handle.index]

    def _string(self, value: str) -> str | bytes:
        return value.encode() if self.strings_as_bytes else value

    def _processes(self, entries: list[tuple[int, int | None]]) -> list[SimpleNamespace]:
        return [
            SimpleNamespace(
                pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF
            )
            for pid, used in entries
        ]

    # -- pynvml's functions --------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._enter("nvmlInit", needs_init=False)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        self._enter("nvmlSystemGetDriverVersion")
        return self._string(self.driver_version)

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByIndex", index)
        if not 0 <= index < len(self.devices):
            raise pynvml.NVMLError_InvalidArgument()
        return FakeHandle(index)

    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes:
        return self._string(self._device("nvmlDeviceGetUUID", handle).uuid)

    def nvmlDeviceGetName(self, handle: Any) -> str | bytes:
        return self._string(self._device("nvmlDeviceGetName", handle).name)

    def nvmlDeviceGetPciInfo(self, handle: Any) -> SimpleNamespace:
        device = self._device("nvmlDeviceGetPciInfo", handle)
        if device.bus_id is None:
            raise pynvml.NVMLError_NotSupported()
        return SimpleNamespace(busId=self._string(device.bus_id))

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> SimpleNamespace:
        if version is not None and not self.binding_has_memory_v2:
            raise TypeError(
                "nvmlDeviceGetMemoryInfo() got an unexpected keyword argument 'version'"
            )
        if not version:
            device = self._device("nvmlDeviceGetMemoryInfo", handle)
            # v1: `used` is total - free, reserved memory included.
            return SimpleNamespace(
                total=device.total, free=device.free, used=device.total - device.free
            )
        # Counted as nvmlDeviceGetMemoryInfo_v2; failures of either name apply.
        device = self._device("nvmlDeviceGetMemoryInfo_v2", handle, ("nvmlDeviceGetMemoryInfo",))
        if not device.memory_v2:
            raise pynvml.NVMLError_FunctionNotFound()
        return SimpleNamespace(
            version=version,
            total=device.total,
            reserved=device.reserved,
            free=device.free,
            used=device.used,
        )

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[SimpleNamespace]:
        if not self.driver_has_v3_processes:
            self.calls[("nvmlDeviceGetComputeRunningProcesses", _index(handle))] += 1
            raise pynvml.NVMLLibraryMismatchError("Unversioned function called ...")
        device = self._device("nvmlDeviceGetComputeRunningProcesses", handle)
        return self._processes(device.compute)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any) -> list[SimpleNamespace]:
        device = self._device(
            "nvmlDeviceGetComputeRunningProcesses_v2",
            handle,
            ("nvmlDeviceGetComputeRunningProcesses",),
        )
        return self._processes(device.compute)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[SimpleNamespace]:
        if not self.driver_has_v3_processes:
            self.calls[("nvmlDeviceGetGraphicsRunningProcesses", _index(handle))] += 1
            raise pynvml.NVMLLibraryMismatchError("Unversioned function called ...")
        device = self._device("nvmlDeviceGetGraphicsRunningProcesses", handle)
        return self._processes(device.graphics)

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: Any) -> list[SimpleNamespace]:
        device = self._device(
            "nvmlDeviceGetGraphicsRunningProcesses_v2",
            handle,
            ("nvmlDeviceGetGraphicsRunningProcesses",),
        )
        return self._processes(device.graphics)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> SimpleNamespace:
        device = self._device("nvmlDeviceGetUtilizationRates", handle)
        if device.utilization is None:
            raise pynvml.NVMLError_NotSupported()
        gpu, memory = device.utilization
        return SimpleNamespace(gpu=gpu, memory=memory)

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        device = self._device("nvmlDeviceGetTemperature", handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise pynvml.NVMLError_InvalidArgument()
        if device.temperature is None:
            raise pynvml.NVMLError_NotSupported()
        return device.temperature


def _index(handle: Any) -> int | None:
    return handle.index if isinstance(handle, FakeHandle) else None


class FakeClock:
    """A monotonic clock that tests move by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
