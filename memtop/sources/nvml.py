"""Device memory, utilisation and GPU processes as the NVIDIA driver reports them, through NVML.

`NvmlSource.read()` is called by the sampler thread about once a second and never raises: every
failure becomes data, either `DriverReading(available=False, error=...)` when NVML as a whole is
unusable (no driver, driver not loaded, no permission) or a `DeviceReading.error` line with the
fields that could not be read set to None (GPU fallen off the bus, a query not supported, …).

The NVML bindings are reached only through the module-like `lib` object given to `NvmlSource`
(`pynvml` from nvidia-ml-py by default, imported lazily on the first read, and not at all where no
NVML can be: driver_libraries.nvml_absent). Tests pass a fake and
`memtop demo` passes a simulated NVML with the same function names. Errors are classified by the
class name (`NVMLError_GpuIsLost`, …) or, failing that, by the NVML return code in the `value`
attribute that pynvml's errors carry, so a lib may bring its own error classes.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from memtop.model import SOURCE_NVML, DeviceReading, GpuProcess, MigInfo
from memtop.protocol.text import canonical_pci_bus_id
from memtop.sources.device_source import (
    DEFAULT_RETRY_INTERVAL,
    DriverDevice,
    DriverLibrarySource,
    joined_errors,
)
from memtop.sources.driver_libraries import (
    DriverLibraryRefused,
    as_root,
    checked_nvml,
    nvml_absent,
)
from memtop.sources.driver_text import DriverDown
from memtop.sources.driver_text import driver_text as _text
from memtop.sources.driver_text import one_line as _one_line

__all__ = ["DEFAULT_RETRY_INTERVAL", "NvmlSource", "nvml_error_line"]

_LOG = logging.getLogger(__name__)

# NVML return codes (nvml.h). They are part of the C ABI and stable across driver versions.
_UNINITIALIZED = 1
_INVALID_ARGUMENT = 2
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_NOT_FOUND = 6
_INSUFFICIENT_POWER = 8
_DRIVER_NOT_LOADED = 9
_TIMEOUT = 10
_IRQ_ISSUE = 11
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_CORRUPTED_INFOROM = 14
_GPU_IS_LOST = 15
_RESET_REQUIRED = 16
_OPERATING_SYSTEM = 17
_LIB_RM_VERSION_MISMATCH = 18
_MEMORY = 20
_ARGUMENT_VERSION_MISMATCH = 25
_GPU_NOT_FOUND = 28
_UNKNOWN = 999

_CODE_BY_CLASS_NAME: dict[str, int] = {
    "NVMLError_Uninitialized": _UNINITIALIZED,
    "NVMLError_InvalidArgument": _INVALID_ARGUMENT,
    "NVMLError_NotSupported": _NOT_SUPPORTED,
    "NVMLError_NoPermission": _NO_PERMISSION,
    "NVMLError_NotFound": _NOT_FOUND,
    "NVMLError_InsufficientPower": _INSUFFICIENT_POWER,
    "NVMLError_DriverNotLoaded": _DRIVER_NOT_LOADED,
    "NVMLError_Timeout": _TIMEOUT,
    "NVMLError_IrqIssue": _IRQ_ISSUE,
    "NVMLError_LibraryNotFound": _LIBRARY_NOT_FOUND,
    "NVMLError_FunctionNotFound": _FUNCTION_NOT_FOUND,
    "NVMLError_CorruptedInforom": _CORRUPTED_INFOROM,
    "NVMLError_GpuIsLost": _GPU_IS_LOST,
    "NVMLError_ResetRequired": _RESET_REQUIRED,
    "NVMLError_OperatingSystem": _OPERATING_SYSTEM,
    "NVMLError_LibRmVersionMismatch": _LIB_RM_VERSION_MISMATCH,
    "NVMLError_Memory": _MEMORY,
    "NVMLError_ArgumentVersionMismatch": _ARGUMENT_VERSION_MISMATCH,
    "NVMLError_GpuNotFound": _GPU_NOT_FOUND,
    "NVMLError_Unknown": _UNKNOWN,
    # Not an NVMLError: raised by nvidia-ml-py's unversioned wrappers (e.g.
    # nvmlDeviceGetComputeRunningProcesses) when the driver lacks the versioned symbol they call.
    "NVMLLibraryMismatchError": _FUNCTION_NOT_FOUND,
}

# The device cannot be queried any more until it is reset or re-enumerated.
_LOST_CODES = frozenset({_GPU_IS_LOST, _RESET_REQUIRED, _GPU_NOT_FOUND})
# NVML as a whole stopped working (driver unloaded or replaced, someone shut NVML down).
_DOWN_CODES = frozenset(
    {_UNINITIALIZED, _DRIVER_NOT_LOADED, _LIBRARY_NOT_FOUND, _LIB_RM_VERSION_MISMATCH}
)
# The query does not exist for this device or driver: stop asking.
_ABSENT_CODES = frozenset({_NOT_SUPPORTED, _FUNCTION_NOT_FOUND})

# NVML_VALUE_NOT_AVAILABLE for unsigned long long fields (e.g. usedGpuMemory under WDDM or in
# some containers); recent nvidia-ml-py maps it to None, older versions pass it through.
_VALUE_NOT_AVAILABLE = 2**64 - 1

_LIBRARY_NAME = "nvml.dll" if sys.platform.startswith("win") else "libnvidia-ml.so.1"

_MESSAGES: dict[int, str] = {
    _LIBRARY_NOT_FOUND: (
        f"NVML not available: {_LIBRARY_NAME} not found (no NVIDIA driver on this machine)"
    ),
    _DRIVER_NOT_LOADED: "NVML: driver not loaded (the nvidia kernel module is not running)",
    _NO_PERMISSION: "NVML: insufficient permissions",
    _LIB_RM_VERSION_MISMATCH: (
        "NVML: library and driver versions differ (driver updated without a reboot?)"
    ),
    _FUNCTION_NOT_FOUND: "NVML: function not found (nvidia-ml-py newer than the driver)",
    _NOT_SUPPORTED: "not supported",
    _UNINITIALIZED: "NVML: not initialised",
    _GPU_IS_LOST: "GPU is lost (fallen off the bus)",
    _RESET_REQUIRED: "GPU requires a reset",
    _GPU_NOT_FOUND: "GPU not found (removed?)",
    _TIMEOUT: "NVML: timed out",
    _IRQ_ISSUE: "NVML: driver interrupt (IRQ) issue",
    _CORRUPTED_INFOROM: "NVML: corrupted infoROM",
    _OPERATING_SYSTEM: "NVML: request blocked by the operating system",
    _INSUFFICIENT_POWER: "NVML: insufficient external power",
    _MEMORY: "NVML: driver out of memory",
    _ARGUMENT_VERSION_MISMATCH: "NVML: structure version not supported by the driver",
}

_PROCESS_QUERIES = (
    ("compute", "nvmlDeviceGetComputeRunningProcesses"),
    ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
)


class _LibraryAbsent(Exception):
    """No NVML on this box (driver_libraries.nvml_absent), told without importing the bindings:
    the failure their nvmlInit reports there (NVMLError_LibraryNotFound), and its line."""


def _error_code(exc: BaseException) -> int | None:
    """The NVML return code behind `exc`, or None when it is not an NVML error."""
    if isinstance(exc, _LibraryAbsent):
        return _LIBRARY_NOT_FOUND
    for cls in type(exc).__mro__:
        code = _CODE_BY_CLASS_NAME.get(cls.__name__)
        if code is not None:
            return code
    if any(cls.__name__ == "NVMLError" for cls in type(exc).__mro__):
        value = getattr(exc, "value", None)
        return value if isinstance(value, int) else _UNKNOWN
    return None


def _describe(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # pynvml's __str__ calls into the library, which may be gone
        text = ""
    return _one_line(text) or type(exc).__name__


def nvml_error_line(exc: BaseException) -> str:
    """One line, fit for a status bar, that says what an NVML failure means."""
    code = _error_code(exc)
    if code is not None:
        message = _MESSAGES.get(code)
        if message is not None:
            return message
        return f"NVML error: {_describe(exc)}"
    if isinstance(exc, DriverLibraryRefused):
        return _one_line(str(exc))
    if isinstance(exc, ImportError):
        return "NVML not available: the nvidia-ml-py package (pynvml) is not installed"
    return _one_line(f"NVML: unexpected {type(exc).__name__}: {_describe(exc)}")


def _u64(value: Any) -> int | None:
    if value is None:
        return None
    number = int(value)
    return None if number == _VALUE_NOT_AVAILABLE or number < 0 else number


def _percent(value: Any) -> int | None:
    number = _u64(value)
    return None if number is None or number > 100 else number


# A MIG device's name ends with its profile: "NVIDIA A100-SXM4-80GB MIG 3g.40gb",
# "NVIDIA H100 80GB HBM3 MIG 1c.3g.40gb" (a compute instance of a 3g GPU instance).
_PROFILE_IN_NAME = re.compile(r"\bMIG\s+(\S+)\s*$")
# How often a GPU in MIG mode is asked which instances it has (they are made and destroyed by
# an administrator, rarely, and never while a process uses them).
MIG_RESCAN_S = 10.0


@dataclass
class _Device(DriverDevice):
    """What is cached about one device index between reads: a whole GPU, or (with `parent`) one
    of the MIG instances of a GPU in MIG mode."""

    # True: nvmlDeviceGetMemoryInfo with version=nvmlMemory_v2 works; False: use v1; None: untried.
    memory_v2: bool | None = None
    # A GPU: whether it is in MIG mode (None: not asked yet), its instances, when they were
    # last enumerated.
    mig_mode: bool | None = None
    instances: list[_Device] = field(default_factory=list)
    instances_read_at: float | None = None
    # A MIG instance: its parent GPU and its slot there (nvmlDeviceGetMigDeviceHandleByIndex).
    parent: _Device | None = None
    slot: int = 0
    mig: MigInfo | None = None


class NvmlSource(DriverLibrarySource[_Device]):
    """Polls NVML for every device; see the module docstring.

    `lib` is the module-like object with pynvml's functions and error classes (None: import
    `pynvml` on the first read). `source` is copied into every reading. `clock` is the monotonic
    clock that paces retries. `read()` and `close()` may be called from different threads.
    """

    NAME = "NVML"
    SHUTDOWN = "nvmlShutdown"
    LOST_CODES = _LOST_CODES
    DOWN_CODES = _DOWN_CODES
    ABSENT_CODES = _ABSENT_CODES

    def __init__(
        self,
        lib: Any | None = None,
        source: str = SOURCE_NVML,
        clock: Callable[[], float] = time.monotonic,
        retry_interval: float = DEFAULT_RETRY_INTERVAL,
    ) -> None:
        super().__init__(lib, source, clock, retry_interval)
        # Which variant of a process-list function works with this driver, by base name.
        self._process_functions: dict[str, str] = {}
        self._lib_is_pynvml = False  # the real bindings, which load the library themselves

    @property
    def library_found(self) -> bool:
        """Whether pynvml was imported (it is not where no NVML can be: nvml_absent).  It comes
        with memtop, so its presence says little of the box: listed first, NVML's error is the
        one shown unless a rarer vendor's library is here (memtop.sources.devices)."""
        return self._lib is not None

    def error_line(self, exc: BaseException) -> str:
        return nvml_error_line(exc)

    def _error_code(self, exc: BaseException) -> int | None:
        return _error_code(exc)

    def _query_error(self, key: str, code: int | None, exc: Exception) -> str | None:
        # No permission, or nothing to report (no process, no sensor): not worth a line.
        if code in (_NO_PERMISSION, _NOT_FOUND):
            return None
        return f"{key}: {nvml_error_line(exc)}"

    # -- initialisation ------------------------------------------------------------------------

    def _initialise(self) -> None:
        if self._lib is None or self._lib_is_pynvml:
            # As root, NVML's library only from root's folders, where there is an NVIDIA GPU
            # (memtop.sources.driver_libraries); before every nvmlInit, which loads it again
            # after a failed load.
            # Where root's check found no file, the bindings' nvmlInit must not look by name:
            # the linker would load whatever it finds (a user's file in a glibc-hwcaps folder of
            # LD_LIBRARY_PATH, or on an RPATH), unchecked, as root.
            unchecked = checked_nvml() is None and as_root()
            if self._lib is None:
                # (Without the package, its ImportError is the line, as it always was.)
                if (unchecked or nvml_absent()) and importlib.util.find_spec("pynvml") is not None:
                    raise _LibraryAbsent
                import pynvml

                self._lib = pynvml
                self._lib_is_pynvml = True
            elif unchecked:
                raise _LibraryAbsent
        self._lib.nvmlInit()
        self._initialised = True
        self._driver_version = None
        query = getattr(self._lib, "nvmlSystemGetDriverVersion", None)
        if query is not None:
            try:
                self._driver_version = _text(query())
            except Exception:
                _LOG.debug("nvmlSystemGetDriverVersion failed", exc_info=True)

    def _forget(self) -> None:
        self._process_functions = {}

    # -- one poll ------------------------------------------------------------------------------

    def _devices_to_read(self) -> Iterator[_Device]:
        """The devices to read, re-enumerated when the count changes: each GPU, then its MIG
        instances as reading the GPU found them (a generator: the base class reads each
        device as it is yielded, so a GPU's instances are known by the time they are due)."""
        for device in self._gpus_to_read():
            yield device
            if device.mig_mode and device.down_error is None:
                yield from device.instances

    def _gpus_to_read(self) -> list[_Device]:
        try:
            count = int(self._lib.nvmlDeviceGetCount())
        except Exception as exc:
            code = _error_code(exc)
            if code in _DOWN_CODES or not self._devices:
                raise DriverDown(nvml_error_line(exc)) from exc
            # Keep the known devices: each one reports its own errors below.
            return self._devices
        if count != len(self._devices):
            self._devices = [_Device(index) for index in range(count)]
            self._process_functions = {}
        return self._devices

    def _query_device(self, device: _Device, errors: list[str]) -> DeviceReading:
        if not device.identified:
            self._identify(device, errors)
        total, used, free = self._memory(device, errors)
        if device.parent is None:
            self._read_mig_mode(device)
        # A GPU in MIG mode: its instances list the processes (the driver refuses the parent's
        # list to a user, and gives root the instances' processes again).
        processes = () if device.mig_mode else self._processes(device, errors)
        rates = self._optional(device, "utilization", errors, "nvmlDeviceGetUtilizationRates")
        temperature_sensor = getattr(self._lib, "NVML_TEMPERATURE_GPU", 0)
        temperature = self._optional(
            device, "temperature", errors, "nvmlDeviceGetTemperature", temperature_sensor
        )
        milliwatts = self._optional(device, "power", errors, "nvmlDeviceGetPowerUsage")
        return DeviceReading(
            index=device.index,
            uuid=device.uuid,
            name=device.name,
            total_bytes=total,
            used_bytes=used,
            free_bytes=free,
            utilization_percent=None if rates is None else _percent(getattr(rates, "gpu", None)),
            memory_utilization_percent=(
                None if rates is None else _percent(getattr(rates, "memory", None))
            ),
            temperature_c=None if temperature is None else _u64(temperature),
            processes=processes,
            power_watts=None if _u64(milliwatts) is None else (_u64(milliwatts) or 0) / 1000,
            pci_bus_id=device.pci_bus_id,
            source=self._source,
            error=joined_errors(errors),
            mig=device.mig,
            mig_mode=bool(device.mig_mode),
        )

    def _failed_device(self, device: _Device, error: str) -> DeviceReading:
        return DeviceReading(
            index=device.index,
            uuid=device.uuid,
            name=device.name,
            total_bytes=None,
            used_bytes=None,
            source=self._source,
            error=error,
            pci_bus_id=device.pci_bus_id,
            mig=device.mig,
            mig_mode=bool(device.mig_mode),
        )

    # -- MIG -------------------------------------------------------------------------------------

    def _read_mig_mode(self, gpu: _Device) -> None:
        """Whether `gpu` is in MIG mode and, every MIG_RESCAN_S, which instances it has.  Any
        failure but a lost GPU reads as "not in MIG mode" (a driver or GPU without MIG)."""
        now = self._clock()
        if gpu.instances_read_at is not None and now - gpu.instances_read_at < MIG_RESCAN_S:
            return
        gpu.instances_read_at = now
        mode = getattr(self._lib, "nvmlDeviceGetMigMode", None)
        if mode is None or "mig" in gpu.absent:
            gpu.mig_mode, gpu.instances = False, []
            return
        try:
            current = mode(gpu.handle)[0]
            slots = int(self._lib.nvmlDeviceGetMaxMigDeviceCount(gpu.handle)) if current else 0
        except Exception as exc:
            self._check_fatal(exc)
            if _error_code(exc) in _ABSENT_CODES:
                gpu.absent.add("mig")
            gpu.mig_mode, gpu.instances = False, []
            return
        gpu.mig_mode = bool(current)
        known = {instance.slot: instance for instance in gpu.instances}
        instances = []
        for slot in range(slots):
            try:
                handle = self._lib.nvmlDeviceGetMigDeviceHandleByIndex(gpu.handle, slot)
            except Exception as exc:
                self._check_fatal(exc)
                continue  # NOT_FOUND: no instance in this slot
            instance = known.get(slot) or _Device(gpu.index, parent=gpu, slot=slot)
            instance.handle, instance.identified, instance.down_error = handle, False, None
            instances.append(instance)
        gpu.instances = instances

    def _identify_instance(self, device: _Device, errors: list[str]) -> None:
        """A MIG instance's UUID, name, GPU and compute instance ids and profile.  Its PCI bus
        id is the parent's and is never kept: it would join every instance's trainer with the
        first instance."""
        assert device.parent is not None
        uuid = self._static(device, errors, "nvmlDeviceGetUUID")
        name = self._static(device, errors, "nvmlDeviceGetName") or ""
        ids = []
        for function in ("nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetComputeInstanceId"):
            try:
                ids.append(int(getattr(self._lib, function)(device.handle)))
            except Exception as exc:
                self._check_fatal(exc)
                ids.append(-1)
        profile = self._profile(device, name)
        if uuid is not None and uuid != device.uuid:
            device.memory_v2 = None
            device.absent.clear()
        device.uuid = uuid or device.uuid or f"MIG-{device.parent.uuid}/{ids[0]}/{ids[1]}"
        device.mig = MigInfo(device.parent.index, ids[0], ids[1], profile)
        parent_name = device.parent.name or f"GPU {device.index}"
        device.name = name or f"{parent_name} MIG {profile}"
        device.pci_bus_id = None
        device.identified = True

    def _profile(self, device: _Device, name: str) -> str:
        """ "3g.40gb": from the device's name, else from its attributes (slices, memory)."""
        found = _PROFILE_IN_NAME.search(name)
        if found:
            return found.group(1)
        query = getattr(self._lib, "nvmlDeviceGetAttributes", None)
        if query is not None:
            try:
                attributes = query(device.handle)
                slices = int(attributes.gpuInstanceSliceCount)
                gigabytes = round(int(attributes.memorySizeMB) / 1024)
                if slices > 0 and gigabytes > 0:
                    return f"{slices}g.{gigabytes}gb"
            except Exception as exc:
                self._check_fatal(exc)
        return "unknown profile"

    def _reopen(self, device: _Device, now: float) -> bool:
        """Get the handle of `device.index` (first read, or a retry after it was lost)."""
        if device.parent is not None and device.parent.handle is None:
            device.down_error = "its GPU is not available"
            device.retry_at = now + self._retry_interval
            return False
        try:
            if device.parent is not None:
                handle = self._lib.nvmlDeviceGetMigDeviceHandleByIndex(
                    device.parent.handle, device.slot
                )
            else:
                handle = self._lib.nvmlDeviceGetHandleByIndex(device.index)
        except Exception as exc:
            code = _error_code(exc)
            if code in _DOWN_CODES:
                raise DriverDown(nvml_error_line(exc)) from exc
            device.down_error = nvml_error_line(exc)
            device.retry_at = now + self._retry_interval
            return False
        device.handle = handle
        device.identified = False
        device.down_error = None
        return True

    def _identify(self, device: _Device, errors: list[str]) -> None:
        if device.parent is not None:
            self._identify_instance(device, errors)
            return
        uuid = self._static(device, errors, "nvmlDeviceGetUUID")
        name = self._static(device, errors, "nvmlDeviceGetName")
        if uuid is not None and uuid != device.uuid:
            # Another GPU now sits at this index: forget what was learnt about the old one.
            device.memory_v2 = None
            device.absent.clear()
            device.pci_bus_id = None
            device.mig_mode, device.instances, device.instances_read_at = None, [], None
        device.uuid = uuid if uuid is not None else device.uuid
        device.name = name if name is not None else device.name or f"GPU {device.index}"
        device.pci_bus_id = self._bus_id(device) or device.pci_bus_id
        device.identified = True

    def _bus_id(self, device: _Device) -> str | None:
        """The device's PCI address (nvmlPciInfo_t.busId), or None, silently: it only backs
        up the UUID in the join with agents."""
        query = getattr(self._lib, "nvmlDeviceGetPciInfo", None)
        if query is None:
            return None
        try:
            info = query(device.handle)
        except Exception as exc:
            self._check_fatal(exc)
            return None
        return canonical_pci_bus_id(_text(getattr(info, "busId", "")))

    def _static(self, device: _Device, errors: list[str], function: str) -> str | None:
        query = getattr(self._lib, function, None)
        if query is None:
            return None
        try:
            return _text(query(device.handle))
        except Exception as exc:
            self._check_fatal(exc)
            if _error_code(exc) not in _ABSENT_CODES:
                errors.append(nvml_error_line(exc))
            return None

    def _memory(
        self, device: _Device, errors: list[str]
    ) -> tuple[int | None, int | None, int | None]:
        """(total, used, free). v2 reports `reserved` separately and leaves it out of `used`."""
        lib = self._lib
        version = getattr(lib, "nvmlMemory_v2", None)
        try:
            if device.memory_v2 is not False and version is not None:
                try:
                    info = lib.nvmlDeviceGetMemoryInfo(device.handle, version=version)
                except TypeError:
                    # An old binding without the version argument.
                    if device.memory_v2:
                        raise
                    device.memory_v2 = False
                except Exception as exc:
                    fallback = _error_code(exc) in (*_ABSENT_CODES, _ARGUMENT_VERSION_MISMATCH)
                    if device.memory_v2 or not fallback:
                        raise
                    device.memory_v2 = False
                else:
                    device.memory_v2 = True
                    return _u64(info.total), _u64(info.used), _u64(info.free)
            device.memory_v2 = False
            info = lib.nvmlDeviceGetMemoryInfo(device.handle)
            return _u64(info.total), _u64(info.used), _u64(info.free)
        except Exception as exc:
            self._check_fatal(exc)
            errors.append(f"memory: {nvml_error_line(exc)}")
            return None, None, None

    def _processes(self, device: _Device, errors: list[str]) -> tuple[GpuProcess, ...]:
        """Compute and graphics processes merged by pid (the larger `used` wins)."""
        merged: dict[int, GpuProcess] = {}
        denied = False
        for kind, function in _PROCESS_QUERIES:
            if function in device.absent:
                continue
            try:
                entries = self._process_list(function, device.handle)
            except Exception as exc:
                self._check_fatal(exc)
                code = _error_code(exc)
                if code == _NO_PERMISSION:
                    denied = True
                elif code in _ABSENT_CODES:
                    device.absent.add(function)
                else:
                    errors.append(f"processes: {nvml_error_line(exc)}")
                continue
            if entries is None:
                device.absent.add(function)
                continue
            for entry in entries:
                pid = int(entry.pid)
                used = _u64(getattr(entry, "usedGpuMemory", None))
                known = merged.get(pid)
                if known is None:
                    merged[pid] = GpuProcess(pid=pid, used_bytes=used, kind=kind)
                elif used is not None and (known.used_bytes is None or used > known.used_bytes):
                    merged[pid] = GpuProcess(pid=pid, used_bytes=used, kind=known.kind)
        if denied:
            errors.append("no permission to list processes")
            return ()
        return tuple(merged[pid] for pid in sorted(merged))

    def _process_list(self, function: str, handle: Any) -> list[Any] | None:
        """Call `function`, falling back to its `_v2` variant on drivers that lack the newest.

        nvidia-ml-py's unversioned wrapper calls the newest symbol (`_v3`) and raises
        NVMLLibraryMismatchError when the driver does not export it (drivers before 510).
        """
        known = self._process_functions.get(function)
        candidates = (known,) if known else (function, f"{function}_v2")
        missing: Exception | None = None
        for name in candidates:
            query = getattr(self._lib, name, None)
            if query is None:
                continue
            try:
                result = query(handle)
            except Exception as exc:
                if _error_code(exc) == _FUNCTION_NOT_FOUND:
                    missing = exc
                    continue
                raise
            self._process_functions[function] = name
            return list(result or ())
        if missing is not None:
            raise missing
        return None  # the lib (a simulated one, say) does not have it
