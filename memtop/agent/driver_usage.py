"""What the driver says each process holds on one GPU, read for an OOM report.

An OOM report must tell this process's own memory outside PyTorch (NCCL buffers, cuDNN and
cuBLAS workspaces, another library's allocations, the CUDA context) from other processes': the
allocator's counters see neither, and `free` from the driver mixes both.  NVML's per-process
list does.  It is read through the driver's own library with ctypes (the agent loads no pynvml:
it lives in the user's trainer, whose environment may not have it), only on the agent's I/O
worker (never the trainer's thread), once per OOM report, and every failure is None: a report
without the split says "unknown", it is never late or missing for it.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

NVML_SUCCESS = 0
NVML_ERROR_INSUFFICIENT_SIZE = 7
MAX_PROCESSES = 1024  # a bound on what one call may return
_lock = threading.Lock()  # nvmlInit/nvmlShutdown are reference counted; one reader at a time


class _ProcessInfo(ctypes.Structure):
    # nvmlProcessInfo_t of nvmlDeviceGetComputeRunningProcesses_v3 (v2 has the same layout).
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


NOT_AVAILABLE = (1 << 64) - 1  # NVML_VALUE_NOT_AVAILABLE (used memory hidden, e.g. on MIG)


def _library() -> Any:
    return ctypes.CDLL("libnvidia-ml.so.1")


def read_driver_usage(uuid: str | None) -> dict[str, Any] | None:
    """{"processes": {pid: used bytes}, "own_pid": this process's pid} for the GPU `uuid`, as
    the driver counts them; None when NVML, the GPU or its process list cannot be read."""
    if not uuid:
        return None
    with _lock:
        try:
            lib = _library()
        except OSError:
            return None
        try:
            if lib.nvmlInit_v2() != NVML_SUCCESS:
                return None
        except AttributeError:
            return None
        try:
            return _processes(lib, uuid)
        except (AttributeError, OSError, ValueError):
            return None
        finally:
            lib.nvmlShutdown()


def _processes(lib: Any, uuid: str) -> dict[str, Any] | None:
    handle = ctypes.c_void_p()
    # torch gives the UUID bare; NVML wants it prefixed, `GPU-` or, for a MIG instance, `MIG-`.
    names = [uuid] if uuid[:4].upper() in ("GPU-", "MIG-") else [f"GPU-{uuid}", f"MIG-{uuid}"]
    if not any(
        lib.nvmlDeviceGetHandleByUUID(name.encode(), ctypes.byref(handle)) == NVML_SUCCESS
        for name in names
    ):
        return None
    function = (
        getattr(lib, "nvmlDeviceGetComputeRunningProcesses_v3", None)
        or lib.nvmlDeviceGetComputeRunningProcesses_v2
    )
    count = ctypes.c_uint(0)
    code = function(handle, ctypes.byref(count), None)
    if code not in (NVML_SUCCESS, NVML_ERROR_INSUFFICIENT_SIZE):
        return None
    size = min(MAX_PROCESSES, count.value + 8)  # room for processes started meanwhile
    count = ctypes.c_uint(size)
    infos = (_ProcessInfo * size)()
    if function(handle, ctypes.byref(count), infos) != NVML_SUCCESS:
        return None
    processes = {
        int(info.pid): int(info.usedGpuMemory)
        for info in infos[: min(count.value, size)]
        if info.usedGpuMemory != NOT_AVAILABLE
    }
    return {"processes": processes, "own_pid": os.getpid()}


def split_usage(usage: dict[str, Any] | None, reserved_bytes: int | None) -> dict[str, Any]:
    """The report's fields: this process's bytes outside PyTorch (what the driver counts for it
    beyond torch's reserved) and every other process's, None where unknown (in a container the
    driver's pids are the host's, so this process may not be found)."""
    unknown = {"own_non_pytorch_bytes": None, "other_processes_bytes": None}
    if not usage or not isinstance(usage.get("processes"), dict):
        return unknown
    processes: dict[int, int] = usage["processes"]
    own = processes.get(usage.get("own_pid", -1))
    if own is None:
        return unknown
    others = sum(used for pid, used in processes.items() if pid != usage.get("own_pid"))
    return {
        "own_non_pytorch_bytes": max(0, own - (reserved_bytes or 0)),
        "other_processes_bytes": others,
        "driver_processes": len(processes),
    }
