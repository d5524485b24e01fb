"""AMD GPUs as the amdgpu driver reports them, through AMD's own `amdsmi` Python package.

`amdsmi` (the `amd` extra) is pure Python over ctypes: importing it loads `libamd_smi.so` from
`$ROCM_HOME/lib` or `$ROCM_PATH/lib`, the linker's path, or `/opt/rocm/lib`.  Written against
amdsmi 7.0 (ROCm 7.0); see the README's "AMD GPUs" section for what has run where.

`AmdSmiSource.read()` is the same contract as `NvmlSource.read()`: called about once a second by
the sampler's device thread, it never raises.  A failure is data: `DriverReading(available=False,
error=...)` when amdsmi as a whole is unusable (package or library missing, driver not loaded,
no permission) and a `DeviceReading.error` line for one GPU (lost, a query refused).

The library is reached only through the module-like `lib` given to `AmdSmiSource` (the `amdsmi`
package by default, imported on the first read).  Its errors are classified by the status code
they carry (`AmdSmiLibraryException.err_code`, the `amdsmi_status_t` of amdsmi.h), so a lib may
bring its own exception classes.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from memtop.model import SOURCE_AMDSMI, DeviceReading, GpuProcess
from memtop.protocol.text import canonical_pci_bus_id
from memtop.sources.device_source import (
    DEFAULT_RETRY_INTERVAL,
    DriverDevice,
    DriverLibrarySource,
    joined_errors,
)
from memtop.sources.driver_libraries import DriverLibraryRefused, as_root, checked_amdsmi
from memtop.sources.driver_text import driver_text as _text
from memtop.sources.driver_text import one_line as _one_line

__all__ = ["AmdSmiSource", "amdsmi_error_line"]

_LOG = logging.getLogger(__name__)

# amdsmi_status_t (amdsmi.h): part of the C ABI.
_INVAL = 1
_NOT_SUPPORTED = 2
_NOT_YET_IMPLEMENTED = 3
_FAIL_LOAD_MODULE = 4
_FAIL_LOAD_SYMBOL = 5
_DRM_ERROR = 6
_TIMEOUT = 8
_RETRY = 9
_NO_PERM = 10
_IO = 12
_FILE_ERROR = 14
_INIT_ERROR = 18
_BUSY = 30
_NOT_FOUND = 31
_NOT_INIT = 32
_DRIVER_NOT_LOADED = 34
_NO_DATA = 40
_FILE_NOT_FOUND = 52
_AMDGPU_RESTART_ERR = 54

# The GPU stopped answering: its sysfs and DRM nodes are gone (fallen off the bus, removed, or
# a reset that failed).  Query it again only after the retry interval.
_LOST_CODES = frozenset({_NOT_FOUND, _IO, _FILE_ERROR, _FILE_NOT_FOUND, _AMDGPU_RESTART_ERR})
# amdsmi as a whole stopped working: shut it down and initialise again later.
_DOWN_CODES = frozenset(
    {_NOT_INIT, _DRIVER_NOT_LOADED, _FAIL_LOAD_MODULE, _FAIL_LOAD_SYMBOL, _INIT_ERROR}
)
# The query does not exist for this GPU or driver (an APU's VRAM, a sensor a board lacks).
_ABSENT_CODES = frozenset({_NOT_SUPPORTED, _NOT_YET_IMPLEMENTED, _NO_DATA})

LIBRARY_NAME = "libamd_smi.so"
VENDOR = "amd"  # DeviceReading.vendor

_MESSAGES: dict[int, str] = {
    _NO_PERM: "amdsmi: insufficient permissions (the user needs the render and video groups)",
    _DRIVER_NOT_LOADED: "amdsmi: driver not loaded (the amdgpu kernel module is not running)",
    _INIT_ERROR: "amdsmi: initialisation failed (is /dev/kfd there and readable?)",
    _NOT_INIT: "amdsmi: not initialised",
    _FAIL_LOAD_MODULE: f"amdsmi: {LIBRARY_NAME} failed to load a module it needs",
    _FAIL_LOAD_SYMBOL: f"amdsmi: {LIBRARY_NAME} lacks a function (amdsmi newer than ROCm?)",
    _NOT_FOUND: "GPU not found (fallen off the bus or removed?)",
    _IO: "GPU is lost (I/O error reading it)",
    _FILE_ERROR: "GPU is lost (its sysfs files cannot be read)",
    _FILE_NOT_FOUND: "GPU is lost (its sysfs files are gone)",
    _AMDGPU_RESTART_ERR: "GPU is lost (the amdgpu restart failed)",
    _DRM_ERROR: "amdsmi: DRM error",
    _TIMEOUT: "amdsmi: timed out",
    _RETRY: "amdsmi: busy, retrying",
    _BUSY: "amdsmi: device busy",
    _NOT_SUPPORTED: "not supported",
    _INVAL: "amdsmi: invalid argument",
}

NOT_INSTALLED = "amdsmi not available: the amdsmi package is not installed (pip install amdsmi)"
NO_LIBRARY = f"amdsmi not available: {LIBRARY_NAME} not found (no ROCm on this machine)"

# 0xFFFF and the all-ones integers are amdsmi's "N/A"; its Python layer also says "N/A".
_NOT_AVAILABLE = frozenset({0xFFFF, 0xFFFFFFFF, 2**64 - 1})


class _LibraryMissing(Exception):
    """Internal: the package or libamd_smi.so is not on this machine."""


class _LibraryRefused(_LibraryMissing):
    """Internal: libamd_smi.so is on this machine, and memtop (as root) does not load it."""


def _error_code(exc: BaseException) -> int | None:
    """The amdsmi status behind `exc`, or None when it is not an amdsmi library error."""
    for name in ("err_code", "value"):
        code = getattr(exc, name, None)
        if isinstance(code, int) and not isinstance(code, bool):
            return abs(code)
    return None


def amdsmi_error_line(exc: BaseException) -> str:
    """One line, fit for a status bar, that says what an amdsmi failure means."""
    if isinstance(exc, _LibraryMissing):
        return str(exc)
    code = _error_code(exc)
    if code is not None:
        message = _MESSAGES.get(code)
        return message if message is not None else f"amdsmi error {code}"
    try:
        text = str(exc)
    except Exception:
        text = ""
    return _one_line(f"amdsmi: unexpected {type(exc).__name__}: {text}")


def import_amdsmi() -> Any:
    """The `amdsmi` package, or _LibraryMissing with the line to show.

    amdsmi's wrapper loads libamd_smi.so as it is imported; when the library is not there it
    prints two lines to stdout (which would land in `--once --json` or on the dashboard) and
    fails with a KeyError.  Its output is kept from stdout and the failure said in one line."""
    spec = importlib.util.find_spec("amdsmi")
    if spec is None or not spec.submodule_search_locations:
        raise _LibraryMissing(NOT_INSTALLED)
    package = Path(next(iter(spec.submodule_search_locations)))
    foreign = _foreign(package)
    if foreign is not None:
        # `python -m memtop` puts the working directory first on sys.path: as root in a
        # directory another user writes to, their `amdsmi` would run as root.
        raise _LibraryMissing(f"amdsmi not loaded: {foreign}")
    # As root: only a libamd_smi.so of root's, where there is an AMD GPU, and pinned to it
    # (memtop.sources.driver_libraries); never the linker's path, which LD_LIBRARY_PATH sets.
    try:
        library = checked_amdsmi()
    except DriverLibraryRefused as refused:
        raise _LibraryRefused(str(refused)) from None
    if as_root() and library is None:
        raise _LibraryMissing(NO_LIBRARY)
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), _rocm_home(library):
            return importlib.import_module("amdsmi")
    except (KeyError, OSError) as exc:
        _LOG.debug("import amdsmi: %s (%s)", exc, said.getvalue().strip())
        raise _LibraryMissing(NO_LIBRARY) from None
    except AttributeError as exc:  # the library lacks a symbol the wrapper binds at import
        raise _LibraryMissing(
            _one_line(f"amdsmi not available: {LIBRARY_NAME} does not match the package: {exc}")
        ) from None


@contextlib.contextmanager
def _rocm_home(library: str | None) -> Iterator[None]:
    """ROCM_HOME set, while amdsmi is imported, to the ROCm that holds `library`: the first
    place the package tries (and then finds loaded already)."""
    if library is None:
        yield
        return
    before = os.environ.get("ROCM_HOME")
    os.environ["ROCM_HOME"] = os.path.dirname(os.path.dirname(library))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("ROCM_HOME", None)
        else:
            os.environ["ROCM_HOME"] = before


def _foreign(package: Path) -> str | None:
    """Why the amdsmi package at `package` must not be imported by this user: a file in it that
    another user owns or may write (None: it is root's or ours, and only its owner writes)."""
    me = os.getuid()
    try:
        for path in (package, *sorted(package.glob("*.py"))[:64]):
            info = path.stat()
            if info.st_uid not in (0, me):
                return f"{path} belongs to uid {info.st_uid}"
            if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return f"{path} is writable by others"
    except OSError as exc:
        return f"{package}: {exc.strerror or exc}"
    return None


def _number(value: Any) -> int | None:
    """An amdsmi figure, None for its "N/A" (a string, or an all-ones integer)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = int(value)
    return None if number < 0 or number in _NOT_AVAILABLE else number


class AmdSmiSource(DriverLibrarySource[DriverDevice]):
    """Polls amdsmi for every AMD GPU (by its position in amdsmi's processor list); see the
    module docstring.

    `lib`: the module-like object with amdsmi's functions (None: import `amdsmi` on the first
    read).  `read()` and `close()` may be called from different threads.
    """

    NAME = "amdsmi"
    SHUTDOWN = "amdsmi_shut_down"
    LOST_CODES = _LOST_CODES
    DOWN_CODES = _DOWN_CODES
    ABSENT_CODES = _ABSENT_CODES

    def __init__(
        self,
        lib: Any | None = None,
        clock: Callable[[], float] = time.monotonic,
        retry_interval: float = DEFAULT_RETRY_INTERVAL,
    ) -> None:
        super().__init__(lib, SOURCE_AMDSMI, clock, retry_interval)
        # The package or library is missing: that does not change while memtop runs, so it is
        # not looked for again (an import of amdsmi costs ~0.1 s of CPU).
        self._missing: str | None = None
        self._refused = False  # the library is here but not loaded: its line is the one shown

    @property
    def library_found(self) -> bool:
        """Whether amdsmi and libamd_smi.so are on this machine (False until a read said so).
        Where they are, the box is an AMD one and amdsmi's errors are the ones to show."""
        return (self._lib is not None and self._missing is None) or self._refused

    def error_line(self, exc: BaseException) -> str:
        return amdsmi_error_line(exc)

    def _error_code(self, exc: BaseException) -> int | None:
        return _error_code(exc)

    # -- initialisation ------------------------------------------------------------------------

    def _ensure_initialised(self) -> str | None:
        if self._missing is not None:
            return self._missing
        error = super()._ensure_initialised()
        if error is None and not self._devices:
            return "amdsmi: no AMD GPU found"
        return error

    def _initialise(self) -> None:
        if self._lib is None:
            try:
                self._lib = import_amdsmi()
            except _LibraryMissing as missing:
                self._missing = str(missing)
                self._refused = isinstance(missing, _LibraryRefused)
                raise
        flags = getattr(self._lib, "AmdSmiInitFlags", None)
        if flags is not None:
            self._lib.amdsmi_init(flags.INIT_AMD_GPUS)
        else:
            self._lib.amdsmi_init()
        self._initialised = True  # from here a failure shuts amdsmi down again
        handles = list(self._lib.amdsmi_get_processor_handles())
        self._devices = [DriverDevice(index, handle) for index, handle in enumerate(handles)]
        self._driver_version = self._read_driver_version()

    def _read_driver_version(self) -> str | None:
        if not self._devices:
            return None
        try:
            info = self._lib.amdsmi_get_gpu_driver_info(self._devices[0].handle)
        except Exception:
            _LOG.debug("amdsmi_get_gpu_driver_info failed", exc_info=True)
            return None
        version = _text(info.get("driver_version", "")) if isinstance(info, dict) else ""
        return version if version and version != "N/A" else None

    # -- one poll ------------------------------------------------------------------------------

    def _devices_to_read(self) -> list[DriverDevice]:
        return self._devices

    def _reopen(self, device: DriverDevice, now: float) -> bool:
        """amdsmi's handle outlives a lost GPU: ask it again, identifying it anew."""
        device.down_error = None
        device.identified = False
        return True

    def _query_device(self, gpu: DriverDevice, errors: list[str]) -> DeviceReading:
        if not gpu.identified:
            self._identify(gpu, errors)
        total = self._optional(gpu, "memory", errors, "amdsmi_get_gpu_memory_total", "VRAM")
        used = self._optional(gpu, "memory", errors, "amdsmi_get_gpu_memory_usage", "VRAM")
        processes = self._processes(gpu, errors)
        activity = self._optional(gpu, "activity", errors, "amdsmi_get_gpu_activity")
        temperature = self._temperature(gpu, errors)
        power = self._optional(gpu, "power", errors, "amdsmi_get_power_info")
        total_bytes, used_bytes = _number(total), _number(used)
        activity = activity if isinstance(activity, dict) else {}
        return DeviceReading(
            index=gpu.index,
            uuid=gpu.uuid,
            name=gpu.name,
            total_bytes=total_bytes,
            used_bytes=used_bytes,
            free_bytes=(
                None
                if total_bytes is None or used_bytes is None
                else max(0, total_bytes - used_bytes)
            ),
            utilization_percent=_percent(activity.get("gfx_activity")),
            memory_utilization_percent=_percent(activity.get("umc_activity")),
            temperature_c=temperature,
            processes=processes,
            power_watts=_watts(power),
            source=SOURCE_AMDSMI,
            error=joined_errors(errors),
            pci_bus_id=gpu.pci_bus_id,
            vendor=VENDOR,
        )

    def _failed_device(self, gpu: DriverDevice, error: str) -> DeviceReading:
        return DeviceReading(
            index=gpu.index,
            uuid=gpu.uuid or f"AMD-GPU-{gpu.index}",  # lost before it could be identified
            name=gpu.name or f"AMD GPU {gpu.index}",
            total_bytes=None,
            used_bytes=None,
            source=SOURCE_AMDSMI,
            error=error,
            pci_bus_id=gpu.pci_bus_id,
            vendor=VENDOR,
        )

    def _identify(self, gpu: DriverDevice, errors: list[str]) -> None:
        uuid = self._optional(gpu, "uuid", errors, "amdsmi_get_gpu_device_uuid")
        bdf = self._optional(gpu, "bdf", errors, "amdsmi_get_gpu_device_bdf")
        asic = self._optional(gpu, "asic", errors, "amdsmi_get_gpu_asic_info")
        name = _text(asic.get("market_name", "")) if isinstance(asic, dict) else ""
        gpu.uuid = _text(uuid) if uuid else gpu.uuid
        gpu.pci_bus_id = canonical_pci_bus_id(bdf) or gpu.pci_bus_id
        gpu.name = name if name and name != "N/A" else gpu.name or f"AMD GPU {gpu.index}"
        if not gpu.uuid:
            # Without a UUID the bus address names the GPU (the store's history is by UUID).
            gpu.uuid = f"PCI-{gpu.pci_bus_id}" if gpu.pci_bus_id else f"AMD-GPU-{gpu.index}"
        gpu.identified = True

    def _arguments(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """amdsmi's AmdSmiMemoryType.<name> for each name (the interface refuses a bare int)."""
        return tuple(getattr(self._lib.AmdSmiMemoryType, name) for name in args)

    def _query_error(self, key: str, code: int | None, exc: Exception) -> str | None:
        if code == _NO_PERM:
            return f"{key}: no permission"
        return f"{key}: {amdsmi_error_line(exc)}"

    def _temperature(self, gpu: DriverDevice, errors: list[str]) -> int | None:
        """The hotspot (junction) sensor, else the edge one: an MI300X has no edge sensor and a
        Radeon may lack the hotspot one.  Degrees Celsius."""
        lib = self._lib
        kinds = getattr(lib, "AmdSmiTemperatureType", None)
        metric = getattr(getattr(lib, "AmdSmiTemperatureMetric", None), "CURRENT", None)
        query = getattr(lib, "amdsmi_get_temp_metric", None)
        if kinds is None or metric is None or query is None:
            return None
        for sensor in ("HOTSPOT", "EDGE"):
            key = f"temperature:{sensor}"
            if key in gpu.absent or not hasattr(kinds, sensor):
                continue
            try:
                return _number(query(gpu.handle, getattr(kinds, sensor), metric))
            except Exception as exc:
                self._check_fatal(exc)
                code = _error_code(exc)
                if code in _ABSENT_CODES:
                    gpu.absent.add(key)
                    continue
                if code != _NO_PERM:
                    errors.append(f"temperature: {amdsmi_error_line(exc)}")
                return None
        return None

    def _processes(self, gpu: DriverDevice, errors: list[str]) -> tuple[GpuProcess, ...]:
        """The processes holding VRAM on `gpu`, by pid.  amdsmi 6.3+ lists each process's
        details; older ones list handles to pass to amdsmi_get_gpu_process_info."""
        if "processes" in gpu.absent:
            return ()
        try:
            entries = list(self._lib.amdsmi_get_gpu_process_list(gpu.handle) or ())[:4096]
            found: dict[int, int | None] = {}
            for entry in entries:
                info = entry
                if not isinstance(info, dict):
                    info = self._lib.amdsmi_get_gpu_process_info(gpu.handle, entry)
                pid = info.get("pid") if isinstance(info, dict) else None
                if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
                    continue
                usage = info.get("memory_usage")
                vram = _number(usage.get("vram_mem")) if isinstance(usage, dict) else None
                known = found.get(pid)
                found[pid] = vram if known is None or (vram or 0) > known else known
        except Exception as exc:
            self._check_fatal(exc)
            code = _error_code(exc)
            if code == _NO_PERM:
                errors.append("no permission to list processes")
            elif code in _ABSENT_CODES:
                gpu.absent.add("processes")
            else:
                errors.append(f"processes: {amdsmi_error_line(exc)}")
            return ()
        return tuple(GpuProcess(pid=pid, used_bytes=found[pid]) for pid in sorted(found))


def _percent(value: Any) -> int | None:
    number = _number(value)
    return None if number is None or number > 100 else number


def _watts(power: Any) -> float | None:
    """The board's draw: MI300 reports the current socket power, older boards the average."""
    if not isinstance(power, dict):
        return None
    for key in ("current_socket_power", "average_socket_power", "socket_power"):
        watts = _number(power.get(key))
        if watts:
            return float(watts)
    return None
